# The load balancer's image where no image registry is reachable: Debian's nginx on a locally
# built base (deploy/base-image.sh). Elsewhere compose uses the official nginx image instead.
#
#   docker build --network host -f deploy/lb.Dockerfile --build-arg BASE=tandem-base:bookworm \
#       -t tandem-lb deploy
#
# (--network host: apt fetches the package from Debian's mirror; compose's TANDEM_LB_IMAGE=tandem-lb.)
ARG BASE=tandem-base:bookworm
FROM ${BASE}
RUN apt-get -o Acquire::Check-Valid-Until=false update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx wget \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /etc/nginx/sites-enabled/default \
    && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 8080
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
