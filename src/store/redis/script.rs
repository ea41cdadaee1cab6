//! The store's Lua, assembled from `lua/`: the batch script (`EVALSHA`) and the same code as a
//! function library (`FCALL`), and the small scripts of the
//! store's actions (reset, pause), each sent by its hash.

use std::time::Duration;

use ::redis::{Cmd, Script};

use super::command::PackedCheck;
use crate::store::{CheckRequest, StoreError};

/// The store's Lua: shared helpers, each algorithm's part, one check of a batch
/// (`lua/entry.lua`), the lean functions of the common case, overrides set at run time, and `batch(KEYS, ARGV)`, the function
/// that runs a batch of checks (`lua/batch.lua`).
macro_rules! library_body {
    () => {
        concat!(
            include_str!("../../../lua/common.lua"),
            include_str!("../../../lua/fixed_window.lua"),
            include_str!("../../../lua/sliding_log.lua"),
            include_str!("../../../lua/sliding_counter.lua"),
            include_str!("../../../lua/token_bucket.lua"),
            include_str!("../../../lua/leases.lua"),
            include_str!("../../../lua/fair.lua"),
            include_str!("../../../lua/entry.lua"),
            include_str!("../../../lua/fast.lua"),
            include_str!("../../../lua/claims.lua"),
            include_str!("../../../lua/overrides.lua"),
            include_str!("../../../lua/batch.lua")
        )
    };
}

/// The store's Lua as a script (`EVALSHA`): for Redis before 7.0, and for clusters, whose nodes
/// come and go without the library.
pub(super) const SCRIPT: &str = concat!(
    "-- tower-redis-ratelimit: a batch of rate-limit checks (see lua/batch.lua)\n",
    library_body!(),
    "return batch(KEYS, ARGV)\n"
);

/// The store's Lua as a Redis function library (`FUNCTION LOAD` once, then `FCALL`): the helpers
/// and the algorithms' parts are made when the library loads, and the shapes it parses are kept,
/// rather than at every call, which saves Redis a few microseconds per call. Its name (also the function's) carries the script's hash, so
/// instances of two versions of the crate sharing a Redis (a rolling deploy) each call their own.
pub(super) struct Library {
    pub(super) name: String,
    pub(super) code: String,
}

pub(super) static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(|| {
    let name = format!(
        "tower_redis_ratelimit_{}",
        &Script::new(SCRIPT).get_hash()[..16]
    );
    let code = format!(
        "#!lua name={name}\n{}redis.register_function('{name}', batch)\n",
        library_body!()
    );
    Library { name, code }
});

/// A small script of `lua/` for one store action, sent as `EVALSHA` of its hash; its text goes to
/// a node only when the node lacks it (`NOSCRIPT`), not at every call.
pub(super) struct ActionScript {
    pub(super) lua: &'static str,
    pub(super) hash: std::sync::LazyLock<String>,
}

macro_rules! action_script {
    ($file:literal) => {
        ActionScript {
            lua: include_str!(concat!("../../../lua/", $file)),
            hash: std::sync::LazyLock::new(|| {
                Script::new(include_str!(concat!("../../../lua/", $file)))
                    .get_hash()
                    .to_owned()
            }),
        }
    };
}

/// Deletes an identity's keys (`lua/reset.lua`).
pub(super) static RESET: ActionScript = action_script!("reset.lua");
/// Sets, removes or lists a policy's overrides set at run time (`lua/override_book.lua`).
pub(super) static OVERRIDE_BOOK: ActionScript = action_script!("override_book.lua");
/// Pauses a key until a time in Redis's clock (`lua/pause.lua`).
pub(super) static PAUSE: ActionScript = action_script!("pause.lua");
/// Reads the time a pause has left (`lua/pause_left.lua`), before each outbound call that waited
/// for its slot is sent.
pub(super) static PAUSE_LEFT: ActionScript = action_script!("pause_left.lua");

/// `EVALSHA <hash of script>`, for the keys and arguments to follow.
pub(super) fn evalsha(script: &ActionScript) -> Cmd {
    let mut command = ::redis::cmd("EVALSHA");
    command.arg(script.hash.as_str());
    command
}

/// The block key of `request`: the last key of a check of it with a block (see `lua/entry.lua`),
/// where a penalty block and a pause are kept.
pub(super) fn block_key(request: &CheckRequest<'_>) -> Result<Vec<u8>, StoreError> {
    // (Without a budget shared fairly, whose keys come after the block's: under its tag still.)
    let request = CheckRequest {
        quota: None,
        block_for: Some(Duration::from_millis(1)),
        fair: None,
        ..*request
    }
    .sharing(request.shared_budget());
    PackedCheck::new(&request, true)
        .keys()
        .last()
        .map(<[u8]>::to_vec)
        .ok_or_else(|| StoreError::Protocol("a check with a block has no block key".into()))
}
