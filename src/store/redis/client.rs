//! The store's client: its one shared connection (taken again after a failure), the version check
//! of each new connection, and a call of the store's Lua on it (`FCALL`, or `EVALSHA` and then
//! `EVAL` when a node lacks the script).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use tokio::time::Instant;

use super::command::{Member, PackedCheck, batch_command};
use super::connection::Connection;
use super::error::{is_no_script, store_error};
use super::merge::Merged;
use super::wire::eval_of;
use crate::decision::Decision;
use crate::store::{ActionFuture, StoreError};

use super::script::{ActionScript, LIBRARY, SCRIPT};
use super::server::{MINIMUM_VERSION, RedisVersion, ServerMode};
use super::{RedisStore, Shared};
use super::{reply, server};

/// The version check of new connections (see [`Shared::connection`]).
#[derive(Default)]
pub(super) struct ServerCheck {
    /// The last server found too old, and when: for a second after, no connection is tried.
    refused: Option<(Instant, RedisVersion)>,
    /// The last too old version logged, so each is logged once, not per request.
    logged: Option<RedisVersion>,
}

/// Why `INFO server` gave no version.
pub(super) enum InfoError {
    /// Redis refused it (`NOPERM`, a renamed command) or answered what names no version.
    Refused(StoreError),
    /// The store failed (an outage).
    Store(StoreError),
}

impl From<InfoError> for StoreError {
    fn from(error: InfoError) -> Self {
        match error {
            InfoError::Refused(error) | InfoError::Store(error) => error,
        }
    }
}

/// How long a server found too old is taken at its word before it is asked again (an upgrade).
pub(super) const RECHECK_OLD_SERVER_AFTER: Duration = Duration::from_secs(1);

impl RedisStore {
    /// Runs `evalsha`, the `EVALSHA` of `script`, on the store's connection; when Redis lacks
    /// the script (a restart, `SCRIPT FLUSH`, a new cluster node), sends its text with `EVAL`,
    /// which also caches it there. Its reply.
    pub(super) fn run_script(
        &self,
        evalsha: Cmd,
        script: &'static ActionScript,
    ) -> impl Future<Output = Result<Value, StoreError>> + Send + 'static {
        let body = script.lua;
        let (shared, timeout) = (self.shared.clone(), self.timeout);
        async move {
            let mut connection = match shared.cached() {
                Some(connection) => connection,
                None => shared.connection(timeout).await?,
            };
            let reply = match shared.send(&mut connection, &evalsha, None, timeout).await {
                Err(error) if is_no_script(&error) => {
                    let eval = eval_of(body, &evalsha);
                    shared.send(&mut connection, &eval, None, timeout).await
                }
                reply => reply,
            };
            reply
                .map(|(value, _)| value)
                .map_err(|error| store_error(error, timeout))
        }
    }

    /// Runs the calls of a change to the run-time overrides, one after another (on a Cluster,
    /// the index's first, then the identity's key).
    pub(super) fn run_book_calls(&self, calls: Result<Vec<Cmd>, StoreError>) -> ActionFuture {
        let calls = calls.map(|calls| {
            calls
                .into_iter()
                .map(|call| self.run_script(call, &super::script::OVERRIDE_BOOK))
                .collect::<Vec<_>>()
        });
        Box::pin(async move {
            for call in calls? {
                call.await?;
            }
            Ok(())
        })
    }

    /// Runs a store action (reset, pause, release): [`RedisStore::run_script`], its reply
    /// dropped.
    pub(super) fn run_action(&self, evalsha: Cmd, script: &'static ActionScript) -> ActionFuture {
        let reply = self.run_script(evalsha, script);
        Box::pin(async move { reply.await.map(drop) })
    }
}

/// How the batches of a [`RedisStore`](super::RedisStore) went since it was made: how many script
/// calls carried how many checks. `checks / script_calls` is the mean batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BatchStats {
    /// Script calls sent (each one batch).
    pub script_calls: u64,
    /// Checks those calls carried (identical give-backs that went as one entry count one
    /// each).
    pub checks: u64,
    /// The most checks one call carried.
    pub largest_batch: u64,
}

/// How many script calls carried how many checks, since the store was made
/// ([`RedisStore::batch_stats`](super::RedisStore::batch_stats)).
#[derive(Default)]
pub(super) struct CallStats {
    calls: AtomicU64,
    checks: AtomicU64,
    largest: AtomicU64,
}

impl CallStats {
    pub(super) fn get(&self) -> BatchStats {
        BatchStats {
            script_calls: self.calls.load(Ordering::Relaxed),
            checks: self.checks.load(Ordering::Relaxed),
            largest_batch: self.largest.load(Ordering::Relaxed),
        }
    }

    fn record(&self, checks: usize) {
        let checks = checks as u64;
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.checks.fetch_add(checks, Ordering::Relaxed);
        self.largest.fetch_max(checks, Ordering::Relaxed);
    }
}

impl Shared {
    /// Sends `member` as a script call of its own.
    pub(super) async fn call_alone(&self, member: &Member) -> Result<Decision, StoreError> {
        let mut decisions = self
            .call(std::slice::from_ref(member), member.deadline)
            .await;
        decisions.pop().unwrap_or_else(|| {
            Err(StoreError::Protocol(
                "a call of one check answered nothing".into(),
            ))
        })
    }

    /// Sends `members` as one script call, giving up at `deadline`, and returns their
    /// decisions, in order.
    pub(super) async fn call(
        &self,
        members: &[Member],
        deadline: Instant,
    ) -> Vec<Result<Decision, StoreError>> {
        self.call_stats.record(members.len());
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let replicas = members.iter().filter_map(|member| member.replicas).max();
        let merged = Merged::of(members);
        let checks: Vec<&PackedCheck> = match &merged {
            Some(merged) => merged.checks(members),
            None => members.iter().map(|member| &member.check).collect(),
        };
        let command = batch_command(
            self.invocation(),
            checks.iter().copied(),
            self.hooks.fixed_time(),
        );
        let replies =
            self.evaluate(&command, replicas, timeout)
                .await
                .and_then(|(reply, acknowledged)| match reply {
                    Value::BulkString(packed) => {
                        let limits = checks.iter().map(|check| &check.limits[..]);
                        Ok((reply::read_batch_reply(&packed, limits)?, acknowledged))
                    }
                    other => Err(StoreError::Protocol(format!(
                        "unexpected batch reply {other:?}"
                    ))),
                });
        let (read, acknowledged) = match replies {
            Ok(replies) => replies,
            Err(error) => return each_gets(error, members.iter().map(|member| member.timeout)),
        };
        let limits = checks.iter().map(|check| &check.limits[..]);
        let decisions: Vec<Result<Decision, StoreError>> = read.into_decisions(limits).collect();
        let decisions = match &merged {
            Some(merged) => fan_out(decisions, merged, members),
            None => decisions,
        };
        decisions
            .into_iter()
            .zip(members)
            .map(|(decision, member)| {
                let decision = decision?;
                // Only an admission must survive a failover: a refusal recorded nothing to lose
                // (but a penalty block, which a lost write only shortens).
                if let (Some(wanted), Some(acknowledged)) = (member.replicas, acknowledged)
                    && acknowledged < i64::from(wanted)
                    && decision.allowed
                {
                    return Err(StoreError::NotReplicated {
                        wanted,
                        acknowledged: u32::try_from(acknowledged).unwrap_or(0),
                    });
                }
                Ok(decision)
            })
            .collect()
    }

    /// Runs a batch's `FCALL` or `EVALSHA` (and its `WAIT`) and returns the reply and the
    /// replicas' acknowledgements, all within `timeout`.
    ///
    /// The common case, a connection at hand and the library (or script) loaded in Redis, is one
    /// send bounded by the connection's own response timeout, so a call arms one timer.
    /// Connecting and loading the library or sending the script itself are rare: they run boxed,
    /// under a deadline for the whole call.
    pub(super) async fn evaluate(
        &self,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let started = Instant::now();
        let missing = match self.cached() {
            Some(mut connection) => {
                match self.send(&mut connection, command, replicas, timeout).await {
                    Ok(reply) => return Ok(reply),
                    Err(error) => match self.lacking(&error) {
                        Some(missing) => missing,
                        None => return Err(store_error(error, timeout)),
                    },
                }
            }
            None => Missing::Connection,
        };
        let slow = self.connect_and_send(missing, command, replicas, timeout);
        match tokio::time::timeout_at(started + timeout, Box::pin(slow)).await {
            Ok(reply) => reply,
            Err(_elapsed) => {
                // A connection that stopped answering without an error (a silently dropped
                // TCP connection) would time out forever: the next request takes a new one.
                self.forget_connection_after_timeout();
                Err(StoreError::Timeout(timeout))
            }
        }
    }

    /// The rare path: takes a connection (a new one if needed) and sends `command`; when Redis
    /// lacks the library (a new server, `FUNCTION FLUSH`) it loads it and sends `command` again;
    /// when it lacks the script (NOSCRIPT: a restart, `SCRIPT FLUSH`, a promoted replica, a new
    /// cluster node) it sends the script itself with `EVAL`, which also caches it on that node;
    /// when it has no functions (before 7.0, or an ACL that forbids them) the store turns to
    /// the script for good.
    pub(super) async fn connect_and_send(
        &self,
        mut missing: Missing,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let mut connection = self.connection(timeout).await?;
        if let Missing::Connection = missing {
            match self.send(&mut connection, command, replicas, timeout).await {
                Err(error) => match self.lacking(&error) {
                    Some(lacking) => missing = lacking,
                    None => return Err(store_error(error, timeout)),
                },
                reply => return reply.map_err(|error| store_error(error, timeout)),
            }
        }
        if let Missing::Function = missing {
            let mut load = ::redis::cmd("FUNCTION");
            load.arg("LOAD").arg("REPLACE").arg(&LIBRARY.code);
            match self.send(&mut connection, &load, None, timeout).await {
                Ok(_) => {
                    return self
                        .send(&mut connection, command, replicas, timeout)
                        .await
                        .map_err(|error| store_error(error, timeout));
                }
                // Redis answered: it won't take the library, so the script it is.
                Err(error) if matches!(error.kind(), ErrorKind::Server(_)) => {
                    tracing::warn!(%error, "Redis refused the rate limiter's function library; using its script");
                    missing = Missing::Functions;
                }
                Err(error) => return Err(store_error(error, timeout)),
            }
        }
        if let Missing::Functions = missing {
            self.functions.store(false, Ordering::Relaxed);
        }
        let eval = eval_of(SCRIPT, command);
        self.send(&mut connection, &eval, replicas, timeout)
            .await
            .map_err(|error| store_error(error, timeout))
    }

    /// What a failed call shows Redis to lack, if anything: the script, the library, or functions
    /// altogether.
    pub(super) fn lacking(&self, error: &RedisError) -> Option<Missing> {
        if is_no_script(error) {
            return Some(Missing::Script);
        }
        if !self.functions.load(Ordering::Relaxed) {
            return None;
        }
        let detail = error.detail().unwrap_or_default();
        match error.kind() {
            ErrorKind::Server(ServerErrorKind::ResponseError)
                if detail.starts_with("Function not found") =>
            {
                Some(Missing::Function)
            }
            ErrorKind::Server(ServerErrorKind::ResponseError)
                if detail.starts_with("unknown command") =>
            {
                Some(Missing::Functions)
            }
            ErrorKind::Server(ServerErrorKind::NoPerm) => Some(Missing::Functions),
            _ => None,
        }
    }

    /// How a batch calls the store's Lua: `FCALL` of the library's function, or `EVALSHA` of the
    /// script.
    pub(super) fn invocation(&self) -> (&'static str, &str) {
        if self.functions.load(Ordering::Relaxed) {
            ("FCALL", &LIBRARY.name)
        } else {
            ("EVALSHA", self.script.get_hash())
        }
    }

    /// Sends `command`; a connection that the failure shows to be broken is dropped so the next
    /// request takes a new one.
    pub(super) async fn send(
        &self,
        connection: &mut Connection,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), RedisError> {
        let reply = connection.send(command, replicas, timeout).await;
        if let Err(error) = &reply
            && connection.is_broken_by(error)
        {
            self.forget_connection();
        }
        reply
    }

    /// The shared connection, or a new one. A new one is used only once `INFO server` shows a
    /// Redis the store runs on (one round trip per connection); a server too old is logged at
    /// ERROR once and refused, without connecting again, for [`RECHECK_OLD_SERVER_AFTER`].
    pub(super) async fn connection(&self, timeout: Duration) -> Result<Connection, StoreError> {
        let _only_one = self.reconnecting.lock().await;
        // Another request may have connected while this one waited for the lock.
        if let Some(connection) = self.cached() {
            return Ok(connection);
        }
        if let Some((at, version)) = self.lock_server().refused
            && at.elapsed() < RECHECK_OLD_SERVER_AFTER
        {
            return Err(server::too_old(version));
        }
        let mut connection = self.connector.connect().await?;
        let version = match self.server_info(&mut connection, timeout).await {
            Ok(found) => found.version,
            // Redis answered, but not with its version (an ACL without INFO, a renamed command):
            // the store goes on, and an old server's scripts would fail as faults.
            Err(InfoError::Refused(error)) => {
                tracing::debug!(%error, "Redis won't tell its version; the store can't check it");
                MINIMUM_VERSION
            }
            Err(InfoError::Store(error)) => return Err(error),
        };
        if let Err(error) = server::supported(version) {
            let mut check = self.lock_server();
            check.refused = Some((Instant::now(), version));
            if check.logged != Some(version) {
                check.logged = Some(version);
                tracing::error!(%error, "the rate limiter can't use this Redis: every check fails as its policy says until it is upgraded");
            }
            return Err(error);
        }
        self.lock_server().refused = None;
        *self.lock_connection() = Some(connection.clone());
        Ok(connection)
    }

    /// The version and mode `INFO server` names on `connection`.
    pub(super) async fn server_info(
        &self,
        connection: &mut Connection,
        timeout: Duration,
    ) -> Result<server::Found, InfoError> {
        let reply = connection
            .query(&::redis::cmd("INFO").arg("server").clone(), timeout)
            .await
            .map_err(|error| match error.kind() {
                ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::ResponseError) => {
                    InfoError::Refused(store_error(error, timeout))
                }
                _ => InfoError::Store(store_error(error, timeout)),
            })?;
        let mut found = server::parse_info_reply(reply).map_err(InfoError::Refused)?;
        if self.connector.is_sentinel() {
            found.mode = ServerMode::SentinelManaged;
        }
        Ok(found)
    }

    pub(super) fn lock_server(&self) -> std::sync::MutexGuard<'_, ServerCheck> {
        self.server.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn cached(&self) -> Option<Connection> {
        self.lock_connection().clone()
    }

    pub(super) fn forget_connection(&self) {
        *self.lock_connection() = None;
    }

    pub(super) fn forget_connection_after_timeout(&self) {
        let mut connection = self.lock_connection();
        if connection
            .as_ref()
            .is_none_or(Connection::replace_after_timeout)
        {
            *connection = None;
        }
    }

    pub(super) fn lock_connection(&self) -> std::sync::MutexGuard<'_, Option<Connection>> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the fast path lacked.
pub(super) enum Missing {
    /// No connection yet, or the last one failed.
    Connection,
    /// Redis answered NOSCRIPT.
    Script,
    /// Redis has functions but not the store's library.
    Function,
    /// Redis has no functions (before 7.0) or won't let the store use them.
    Functions,
}

/// `error` as the error of each of the checks whose store timeouts are `timeouts`: a timeout
/// names each one's own.
pub(super) fn each_gets(
    error: StoreError,
    timeouts: impl Iterator<Item = Duration>,
) -> Vec<Result<Decision, StoreError>> {
    let each = |error: &dyn Fn(Duration) -> StoreError| timeouts.map(|t| Err(error(t))).collect();
    match error {
        StoreError::Unavailable(source) => {
            let source: Arc<dyn std::error::Error + Send + Sync> = Arc::from(source);
            each(&|_| StoreError::Unavailable(Box::new(SharedError(source.clone()))))
        }
        StoreError::Timeout(_) => each(&StoreError::Timeout),
        StoreError::Protocol(message) => each(&|_| StoreError::Protocol(message.clone())),
        StoreError::Script(message) => each(&|_| StoreError::Script(message.clone())),
        StoreError::WrongType(message) => each(&|_| StoreError::WrongType(message.clone())),
        StoreError::OutOfMemory(message) => each(&|_| StoreError::OutOfMemory(message.clone())),
        StoreError::Config(message) => each(&|_| StoreError::Config(message.clone())),
        StoreError::NotReplicated {
            wanted,
            acknowledged,
        } => each(&|_| StoreError::NotReplicated {
            wanted,
            acknowledged,
        }),
        StoreError::UnsupportedVersion { found, minimum } => {
            each(&|_| StoreError::UnsupportedVersion {
                found: found.clone(),
                minimum,
            })
        }
    }
}

/// The decisions of `merged`'s entries as each member's: those of an entry that stands for
/// several give-backs go to each of them (the last of them gets the decision itself, the others
/// a copy; no list per entry).
fn fan_out(
    decisions: Vec<Result<Decision, StoreError>>,
    merged: &Merged,
    members: &[Member],
) -> Vec<Result<Decision, StoreError>> {
    /// An entry's answer, as its members are handed it in order.
    enum Answer {
        /// A decision, and how many members are still to get it.
        Decision(Option<Decision>, usize),
        /// An error, one per member (each names its own timeout).
        Errors(std::vec::IntoIter<Result<Decision, StoreError>>),
    }
    let mut answers: Vec<Answer> = decisions
        .into_iter()
        .enumerate()
        .map(|(entry, decision)| match decision {
            Ok(decision) => Answer::Decision(Some(decision), merged.members_of(entry)),
            Err(error) => {
                let timeouts = merged
                    .entry_of()
                    .iter()
                    .zip(members)
                    .filter(|(of, _)| **of == entry)
                    .map(|(_, member)| member.timeout);
                Answer::Errors(each_gets(error, timeouts).into_iter())
            }
        })
        .collect();
    merged
        .entry_of()
        .iter()
        .map(|&entry| {
            let answer = match answers.get_mut(entry) {
                Some(Answer::Decision(decision, left)) => {
                    *left = left.saturating_sub(1);
                    if *left == 0 {
                        decision.take().map(Ok)
                    } else {
                        decision.clone().map(Ok)
                    }
                }
                Some(Answer::Errors(errors)) => errors.next(),
                None => None,
            };
            answer.unwrap_or_else(|| {
                Err(StoreError::Protocol(
                    "a merged entry answered too few".into(),
                ))
            })
        })
        .collect()
}

/// One error that several checks of a batch report.
#[derive(Debug)]
pub(super) struct SharedError(Arc<dyn std::error::Error + Send + Sync>);

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Algorithm, Rule};
    use crate::store::CheckRequest;

    fn member(check: PackedCheck, timeout_ms: u64) -> Member {
        Member {
            check,
            replicas: None,
            deadline: Instant::now(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn decision(now_unix_ms: u64) -> Decision {
        Decision {
            allowed: true,
            rules: Vec::new(),
            now_unix_ms,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        }
    }

    fn said(answers: &[Result<Decision, StoreError>]) -> Vec<String> {
        answers
            .iter()
            .map(|answer| match answer {
                Ok(decision) => format!("ok {}", decision.now_unix_ms),
                Err(error) => format!("{error:?}"),
            })
            .collect()
    }

    /// Three identical give-backs go as one entry, a check as another: each member is handed its
    /// entry's answer, a decision copied to each of the give-backs, an error naming each member's
    /// own timeout.
    #[test]
    fn merged_give_backs_each_get_their_entry_s_answer() {
        let rules = [Rule::per_minute(30)];
        let charged = decision(5_000);
        let request = CheckRequest::new("rl:api:global", &rules, Algorithm::FixedWindow);
        let give_back = || PackedCheck::new(&request.giving_back(&charged), false);
        let members = [
            member(give_back(), 10),
            member(PackedCheck::new(&request, false), 20),
            member(give_back(), 30),
            member(give_back(), 40),
        ];
        let merged = Merged::of(&members).expect("the give-backs merge");
        assert_eq!(merged.entry_of(), [0, 1, 0, 0]);

        let answers = fan_out(
            vec![Ok(decision(7)), Err(StoreError::Timeout(Duration::ZERO))],
            &merged,
            &members,
        );
        assert_eq!(said(&answers), ["ok 7", "Timeout(20ms)", "ok 7", "ok 7"]);

        let answers = fan_out(
            vec![Err(StoreError::Timeout(Duration::ZERO)), Ok(decision(9))],
            &merged,
            &members,
        );
        assert_eq!(
            said(&answers),
            ["Timeout(10ms)", "ok 9", "Timeout(30ms)", "Timeout(40ms)"]
        );

        // An entry the reply left out answers its members with an error, never a panic.
        let answers = fan_out(vec![Ok(decision(7))], &merged, &members);
        assert!(answers[1].is_err());
        assert!(answers[3].is_ok());
    }
}
