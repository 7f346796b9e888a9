// Embeds one prompt with a Tandem backend's Embed RPC and prints the result as one JSON line:
// {"num_prompt_tokens": N, "embedding": [...]} (fp32 values, unit length unless normalize is off).
//
//   cd protos/examples && npm install
//   node embed_client.js localhost:50051 MEAN 1 4093 338   # address, pooling, then prompt token IDs
//
// The pooling is a PoolingType of engine.proto without its prefix: LAST, MEAN or CLS.
'use strict';

const grpc = require('@grpc/grpc-js');
const { createClient } = require('./generate_client');

function main() {
  const [address = 'localhost:50051', pooling = 'LAST', ...ids] = process.argv.slice(2);
  const client = createClient(address);
  const request = {
    request_id: `node-embed-${process.pid}`,
    prompt_token_ids: ids.length ? ids.map(Number) : [1],
    pooling_type: `POOLING_TYPE_${pooling.toUpperCase()}`,
  };
  client.Embed(request, (error, response) => {
    client.close();
    if (error) {
      console.error(`Embed failed: ${grpc.status[error.code]}: ${error.details}`);
      process.exitCode = 1;
      return;
    }
    console.log(JSON.stringify({ num_prompt_tokens: response.num_prompt_tokens, embedding: response.embedding }));
  });
}

if (require.main === module) {
  main();
}
