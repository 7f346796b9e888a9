// Streams one Generate call from a Tandem backend and prints the token IDs.
//
//   cd protos/examples && npm install
//   node generate_client.js localhost:50051 1 4093 338   # address, then prompt token IDs
//
// The contract is loaded from the .proto at run time: no generated code.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.join(__dirname, '..');

/** Returns an EngineService client for `address` (host:port); connects lazily. */
function createClient(address) {
  const definition = protoLoader.loadSync('tandem/engine/v1/engine.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as written in the .proto: prompt_token_ids
    enums: String, // finish_reason arrives as 'FINISH_REASON_STOP'
    longs: String, // int64/uint64 (seed, file sizes) as strings, never rounded
    defaults: true, // unset scalars read as their zero value
  });
  const { EngineService } = grpc.loadPackageDefinition(definition).tandem.engine.v1;
  return new EngineService(address, grpc.credentials.createInsecure());
}

function main() {
  const address = process.argv[2] || 'localhost:50051';
  const promptTokenIds = process.argv.slice(3).map(Number);
  const client = createClient(address);

  const call = client.Generate({
    request_id: `node-example-${process.pid}`,
    prompt_token_ids: promptTokenIds.length ? promptTokenIds : [1],
    // `optional` fields: setting temperature to 0 (greedy) is sent, unlike leaving it out.
    sampling_params: { temperature: 0, max_tokens: 16 },
  });
  // Cancelling the call aborts the request on the backend and frees its KV cache.
  process.on('SIGINT', () => call.cancel());

  call.on('data', (response) => {
    const finished = response.finish_reason !== 'FINISH_REASON_UNSPECIFIED';
    console.log(`sequence ${response.index}: ${response.new_token_ids.join(' ')}` +
                (finished ? ` [${response.finish_reason}]` : ''));
  });
  call.on('end', () => client.close());
  call.on('error', (error) => {
    console.error(`Generate failed: ${grpc.status[error.code]}: ${error.details}`);
    process.exitCode = 1;
  });
}

module.exports = { createClient };

if (require.main === module) {
  main();
}
