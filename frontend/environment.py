"""What ``tandem serve`` hands the frontend process it starts, and how it knows that process answers.

Secrets travel in the environment, never on the command line (where ``ps``
shows them). ``serve`` puts a random ID in ``$TANDEM_INSTANCE_ID``; the frontend
echoes it on /health in ``X-Tandem-Instance``, so "serving" is announced only
when serve's own frontend answers, never another server that holds the port.
"""

API_KEY_ENV = "TANDEM_API_KEY"  # read when --api-key is not given
INSTANCE_ENV = "TANDEM_INSTANCE_ID"  # the frontend echoes it on /health, in INSTANCE_HEADER
INSTANCE_HEADER = "X-Tandem-Instance"
