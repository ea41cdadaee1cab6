//! The decoder of the Redis store's packed (MessagePack) batch replies. Property: whatever the
//! bytes, it answers (one entry per check, or a protocol error) without panicking.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::fuzzing::read_batch_reply;

#[derive(Debug, Arbitrary)]
struct Input {
    /// The short form's length of each check in the batch (two items per rule).
    checks: Vec<u8>,
    packed: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let lengths: Vec<usize> = input
        .checks
        .iter()
        .map(|&rules| usize::from(rules % 8) * 2)
        .collect();
    let _ = read_batch_reply(&input.packed, &lengths);
});
