//! Real KV between workers, on the SmolLM2-135M GGUF with the native engine: a prompt
//! prefilled on a prefill worker, its KV moved to the decode worker, gives exactly the tokens
//! (and the log-probabilities, bit for bit as JSON prints them) of the same prompt prefilled
//! on the decode worker itself — over every transport (`local`, `tcp`, `ucx`, `inline`) in one
//! process, and across processes on real etcd and NATS.
//!
//! A decode worker killed mid-stream: its streams migrate and equal uninterrupted ones; one
//! drained mid-stream hands them over with their KV, and they equal uninterrupted ones too.
//! A transfer corrupted on the way is caught by its digest, and a prefill worker killed
//! mid-transfer leaves its blocks half written: either way the local prefill the decode
//! worker falls back to answers the same. The transfer is paged: what the decode worker
//! already holds is not sent (the frontend's `tandem_remote_prefill_tokens_total`).
//!
//! The 20 requests: completions of token-id prompts from 10 to 3,050 tokens, greedy and
//! seeded at temperature 0.8; chats; and prompts that repeat, extend or cut an earlier one,
//! whose prefix the decode worker then holds (only the rest is prefilled and moved).
//!
//! The tests sit in the module `native_kv`, so each one's name starts `native_kv::`: CI
//! (scripts/test.sh) runs this binary, the model's forward on both cores for minutes, beside
//! the rest of the suite, which it runs with `--skip native_kv::`.

#[path = "native_kv/suite.rs"]
mod native_kv;
