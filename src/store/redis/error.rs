//! Redis's failures as store errors: a timeout, a fault in Redis's words (a script's error,
//! `WRONGTYPE`, `OOM`), a reply that can't be read, or the store being unavailable.

use std::time::Duration;

use ::redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::store::StoreError;

/// busy) is the store being unavailable, which passes.
pub(super) fn store_error(error: RedisError, timeout: Duration) -> StoreError {
    if error.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::ResponseError) => fault_of(redis_words(&error)),
        ErrorKind::Extension if matches!(error.code(), Some("WRONGTYPE" | "OOM")) => {
            fault_of(redis_words(&error))
        }
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => {
            StoreError::Protocol(error.to_string())
        }
        _ => StoreError::Unavailable(Box::new(error)),
    }
}

/// An error Redis answered a script with, or that the script raised (`words`, as Redis wrote
/// them), as the fault it is: `WRONGTYPE …` a key of the wrong type, `OOM …` a Redis out of
/// memory, anything else the script failing.
pub(super) fn fault_of(words: String) -> StoreError {
    // On one line: Redis 6.2 ends some of its errors with the protocol's CRLF (`-OOM …\r\n`), and
    // a log line must not break.
    let words = if words.contains(['\r', '\n']) {
        words.trim_end().replace(['\r', '\n'], " ")
    } else {
        words
    };
    match code_of(&words) {
        "WRONGTYPE" => StoreError::WrongType(words),
        "OOM" => StoreError::OutOfMemory(words),
        _ => StoreError::Script(words),
    }
}

/// Redis's error code in `words`: its first word, past the places Redis before 7.0 puts before an
/// error raised in a script (`@user_script:65: `, `@user_script: 65: `, `=[C]: -1: `, once or
/// twice) and the `-` of the protocol it may keep (`-OOM command not allowed …`).
fn code_of(words: &str) -> &str {
    let mut rest = words.trim_start();
    while rest.starts_with('@') || rest.starts_with('=') {
        // `<chunk>:<line>: `: the line may be spaced from its colon, and negative.
        let Some((_chunk, after)) = rest.split_once(':') else {
            break;
        };
        let Some((_line, after)) = after.split_once(':') else {
            break;
        };
        rest = after.trim_start();
    }
    rest.trim_start_matches('-')
        .split_whitespace()
        .next()
        .unwrap_or_default()
}

/// A server's error as Redis wrote it, `<CODE> <detail>` (redis-rs displays it its own way).
fn redis_words(error: &RedisError) -> String {
    match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        (Some(code), None) => code.to_owned(),
        _ => error.to_string(),
    }
}

/// A failed command as a store error. A timeout is a [`StoreError::Timeout`] like the store's.
/// Redis's answers that no retry mends are faults, in Redis's words ([`fault_of`]): `ERR` (the
/// script or a command in it failed), `WRONGTYPE` and `OOM`; a reply that can't be parsed is a
/// [`StoreError::Protocol`]. The rest (a connection lost or refused, a node loading, read-only or
pub(super) fn is_no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

#[cfg(test)]
mod tests {
    use ::redis::Value;

    use super::super::wire::replies_of;
    use super::*;

    /// The error of Redis's error answer `line` (`-<line>\r\n` on the wire).
    fn answered(line: &str) -> RedisError {
        match ::redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(Value::ServerError(error)) => error.into(),
            other => panic!("not an error answer: {other:?}"),
        }
    }

    #[test]
    fn redis_answers_that_no_retry_mends_are_faults_in_redis_words() {
        let timeout = Duration::from_millis(250);
        let wrong = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let oom = "OOM command not allowed when used memory > 'maxmemory'.";
        let script = "ERR user_function:2: boom script: f, on @user_function:2.";
        assert!(matches!(store_error(answered(wrong), timeout),
            StoreError::WrongType(words) if words == wrong));
        assert!(matches!(store_error(answered(oom), timeout),
            StoreError::OutOfMemory(words) if words == oom));
        assert!(matches!(store_error(answered(script), timeout),
            StoreError::Script(words) if words == script));
        // What passes: a node loading or read-only, a dropped connection.
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "READONLY You can't write",
        ] {
            let error = store_error(answered(line), timeout);
            assert!(
                matches!(error, StoreError::Unavailable(_)),
                "{line}: {error:?}"
            );
        }
        let dropped = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(
            store_error(dropped, timeout),
            StoreError::Unavailable(_)
        ));
        let late = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(store_error(late, timeout), StoreError::Timeout(t) if t == timeout));
        // A reply that can't be read.
        let unreadable = replies_of(Vec::new()).unwrap_err();
        assert!(matches!(
            store_error(unreadable, timeout),
            StoreError::Protocol(_)
        ));
        let wait = replies_of(vec![Value::Int(1), Value::Nil]).unwrap_err();
        assert!(matches!(
            store_error(wait, timeout),
            StoreError::Protocol(_)
        ));
    }

    #[test]
    fn a_checks_own_error_is_told_by_its_code() {
        assert_eq!(fault_of("WRONGTYPE Operation".into()).kind(), "wrong_type");
        // Redis 6.2 names where in the script the error was raised, before Redis's words.
        let oom = "@user_script:65: @user_script: 65: OOM command not allowed when used memory";
        assert_eq!(fault_of(oom.into()).kind(), "out_of_memory");
        let wrong = "@user_script: 12: WRONGTYPE Operation against a key";
        assert_eq!(fault_of(wrong.into()).kind(), "wrong_type");
        assert_eq!(fault_of("@user_script".into()).kind(), "script");
        let raised = "@user_script: 40: -OOM command not allowed when used memory > 'maxmemory'.";
        assert_eq!(fault_of(raised.into()).kind(), "out_of_memory");
        let direct = "=[C]: -1: -OOM command not allowed when used memory > 'maxmemory'.\r\n";
        let fault = fault_of(direct.into());
        assert_eq!(fault.kind(), "out_of_memory");
        assert!(!fault.to_string().contains(['\r', '\n']), "{fault}");
        assert_eq!(
            fault_of("OOM command not allowed".into()).kind(),
            "out_of_memory"
        );
        assert_eq!(
            fault_of("user_script:12: attempt to compare nil".into()).kind(),
            "script"
        );
        assert_eq!(
            fault_of("ERR value is not an integer".into()).kind(),
            "script"
        );
    }
}
