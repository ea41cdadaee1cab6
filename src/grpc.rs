//! gRPC answers. A gRPC client reads a call's outcome from `grpc-status`, not from the HTTP
//! status: it maps an HTTP 429 without one to `UNAVAILABLE`, which many clients retry at once. So
//! a refused or failed gRPC call (its `content-type` starts with `application/grpc`) is answered
//! as a gRPC server would: HTTP 200, "trailers-only" (the
//! status in the one HEADERS frame, no body), with
//!
//! - `grpc-status` and `grpc-message` (percent-encoded as the gRPC protocol says);
//! - for a rate refusal, `grpc-retry-pushback-ms`, the wait gRPC retry policies read (gRFC A6),
//!   negative when waiting never helps;
//! - with the `grpc` feature, `grpc-status-details-bin`: a `google.rpc.Status` whose details carry
//!   a `google.rpc.RetryInfo` and a `google.rpc.QuotaFailure` (through `tonic-types`).
//!
//! The codes follow the HTTP answers: 429 is `RESOURCE_EXHAUSTED` (8, what Envoy's rate-limit
//! filter answers when asked to), 503 `UNAVAILABLE` (14), and the rest as `google.rpc.Code` maps
//! HTTP statuses.

use std::time::Duration;

use axum::body::Body;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Response, StatusCode};

/// The header of a gRPC call's status code.
pub const GRPC_STATUS: &str = "grpc-status";
/// The header of a gRPC call's status message (percent-encoded).
pub const GRPC_MESSAGE: &str = "grpc-message";
/// The header that tells a gRPC client how long to wait before retrying, in milliseconds
/// (negative: don't retry).
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";
/// The header of a gRPC call's rich status, a base64 `google.rpc.Status`.
pub const GRPC_STATUS_DETAILS_BIN: &str = "grpc-status-details-bin";

/// `RESOURCE_EXHAUSTED`: a quota or rate limit refused the call.
pub(crate) const RESOURCE_EXHAUSTED: u16 = 8;
/// `UNAVAILABLE`: the service can't answer now (its limiter's store is down).
pub(crate) const UNAVAILABLE: u16 = 14;

/// Whether a request is a gRPC call: its `content-type` starts with `application/grpc`
/// (`application/grpc`, `application/grpc+proto`, and gRPC-Web's `application/grpc-web…`, whose
/// clients read a trailers-only answer from the headers as well).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(is_grpc_content_type)
}

/// Whether a `content-type` is a gRPC call's (see [`is_grpc`]).
pub(crate) fn is_grpc_content_type(value: &HeaderValue) -> bool {
    let prefix = b"application/grpc";
    value
        .as_bytes()
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// The gRPC code of an HTTP answer's status, as `google.rpc.Code` pairs them.
pub(crate) fn code_of(status: StatusCode) -> u16 {
    match status.as_u16() {
        400 => 3,                        // INVALID_ARGUMENT
        401 => 16,                       // UNAUTHENTICATED
        403 => 7,                        // PERMISSION_DENIED
        404 => 5,                        // NOT_FOUND
        409 => 10,                       // ABORTED
        413 | 429 => RESOURCE_EXHAUSTED, // what a limit refuses
        499 => 1,                        // CANCELLED
        500 => 13,                       // INTERNAL
        501 => 12,                       // UNIMPLEMENTED
        503 => UNAVAILABLE,              // UNAVAILABLE
        504 => 4,                        // DEADLINE_EXCEEDED
        _ => 2,                          // UNKNOWN
    }
}

/// A trailers-only gRPC answer: HTTP 200, `content-type: application/grpc`, `grpc-status: code`
/// and `grpc-message: message`, no body.
pub(crate) fn trailers_only(code: u16, message: &str) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS, HeaderValue::from(code));
    if !message.is_empty() {
        headers.insert(GRPC_MESSAGE, encode_message(message));
    }
    response
}

/// `response` with the gRPC call's own `content-type`: `application/grpc+proto`, or a gRPC-Web
/// one, whose clients check that their answer is theirs.
pub(crate) fn answered_as(
    mut response: Response<Body>,
    content_type: &HeaderValue,
) -> Response<Body> {
    response
        .headers_mut()
        .insert(CONTENT_TYPE, content_type.clone());
    response
}

/// `grpc-retry-pushback-ms` for a wait of `retry`, or -1 (don't retry) for none. Rounded up and
/// at least 1, as `Retry-After` is: a client that retries when told is never early.
pub(crate) fn pushback(retry: Option<Duration>) -> HeaderValue {
    match retry {
        // The header is a signed 32-bit number: a longer wait is said as the longest it can say.
        Some(retry) => {
            let ms = retry
                .as_nanos()
                .div_ceil(1_000_000)
                .clamp(1, i32::MAX as u128);
            HeaderValue::from(ms as u64)
        }
        None => HeaderValue::from_static("-1"),
    }
}

/// `grpc-message` as the gRPC protocol encodes it: printable ASCII but `%` as is, every other byte
/// of its UTF-8 as `%XX`; a space at either end too, since an HTTP/2 field value may not start
/// or end with one (RFC 9113, 8.2.1).
fn encode_message(message: &str) -> HeaderValue {
    let mut encoded = String::with_capacity(message.len());
    let last = message.len().saturating_sub(1);
    for (at, &byte) in message.as_bytes().iter().enumerate() {
        let at_an_end = at == 0 || at == last;
        if (0x20..=0x7e).contains(&byte) && byte != b'%' && !(byte == b' ' && at_an_end) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    // Only printable ASCII is left, which a header value always takes.
    HeaderValue::try_from(encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// One rule that refused a call, as the rich status's `QuotaFailure` names it.
#[cfg_attr(not(feature = "grpc"), allow(dead_code))]
pub(crate) struct Violation<'a> {
    /// The policy's name: what was limited.
    pub(crate) subject: &'a str,
    /// The rule's name, as in the `RateLimit` header.
    pub(crate) rule: &'a str,
    /// The rule's limit.
    pub(crate) limit: u64,
}

/// `grpc-status-details-bin`: a `google.rpc.Status` of `code` and `message` whose details are a
/// `RetryInfo` (when waiting helps) and a `QuotaFailure` naming the `violations`.
#[cfg(feature = "grpc")]
pub(crate) fn details(
    code: u16,
    message: &str,
    retry: Option<Duration>,
    violations: &[Violation<'_>],
) -> HeaderValue {
    use base64::Engine as _;
    use tonic_types::{ErrorDetails, QuotaViolation, StatusExt as _};

    let mut details = ErrorDetails::new();
    if let Some(retry) = retry {
        details.set_retry_info(Some(retry));
    }
    if !violations.is_empty() {
        let violations: Vec<QuotaViolation> = violations
            .iter()
            .map(|violation| QuotaViolation {
                quota_id: violation.rule.to_owned(),
                quota_value: i64::try_from(violation.limit).unwrap_or(i64::MAX),
                ..QuotaViolation::new(
                    violation.subject,
                    format!("rule \"{}\" is exhausted", violation.rule),
                )
            })
            .collect();
        details.set_quota_failure(violations);
    }
    let status =
        tonic::Status::with_error_details(tonic::Code::from(i32::from(code)), message, details);
    // Unpadded standard base64, as the gRPC protocol asks binary headers to be sent.
    let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(status.details());
    HeaderValue::try_from(encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The wait a gRPC upstream asks for when it refuses a call with `RESOURCE_EXHAUSTED` in a
/// trailers-only answer (how servers and proxies refuse a call before answering it, the status in
/// the response's headers; whatever the HTTP status, gRPC's is what counts): the longer of `grpc-retry-pushback-ms` (a negative one says "don't
/// retry this call", not "wait") and, with the `grpc` feature, the `RetryInfo` of
/// `grpc-status-details-bin`. Malformed values are ignored.
pub(crate) fn announced_wait(headers: &HeaderMap) -> Option<Duration> {
    let code = headers.get(GRPC_STATUS)?.to_str().ok()?.trim();
    if code.parse::<u16>().ok()? != RESOURCE_EXHAUSTED {
        return None;
    }
    let pushback = headers
        .get(GRPC_RETRY_PUSHBACK_MS)
        .and_then(|value| value.to_str().ok()?.trim().parse::<i64>().ok())
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis);
    pushback.into_iter().chain(retry_info(headers)).max()
}

/// The delay of the `RetryInfo` in `grpc-status-details-bin`, if it decodes.
#[cfg(feature = "grpc")]
fn retry_info(headers: &HeaderMap) -> Option<Duration> {
    use base64::Engine as _;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    use tonic_types::StatusExt as _;

    // Padded or not: the gRPC protocol asks receivers to take both.
    const BASE64: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let encoded = headers.get(GRPC_STATUS_DETAILS_BIN)?.as_bytes();
    let details = BASE64.decode(encoded).ok()?;
    let status = tonic::Status::with_details(tonic::Code::ResourceExhausted, "", details.into());
    status.get_details_retry_info()?.retry_delay
}

#[cfg(not(feature = "grpc"))]
fn retry_info(_headers: &HeaderMap) -> Option<Duration> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        let grpc = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
            is_grpc(&headers)
        };
        assert!(grpc("application/grpc"));
        assert!(grpc("application/grpc+proto"));
        assert!(grpc("application/GRPC;charset=utf-8"));
        assert!(grpc("application/grpc-web+proto"));
        assert!(!grpc("application/json"));
        assert!(!grpc("application/grp"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn messages_are_percent_encoded_as_grpc_says() {
        assert_eq!(
            encode_message("Too many: 100% – \"wait\"\n"),
            "Too many: 100%25 %E2%80%93 \"wait\"%0A"
        );
        assert_eq!(encode_message(" slow down "), "%20slow down%20");
    }

    #[test]
    fn a_pushback_is_milliseconds_and_minus_one_says_never() {
        assert_eq!(pushback(Some(Duration::from_millis(1500))), "1500");
        // Never early: a part of a millisecond is a millisecond, and no wait is the least one.
        assert_eq!(pushback(Some(Duration::from_micros(1_500_001))), "1501");
        assert_eq!(pushback(Some(Duration::ZERO)), "1");
        assert_eq!(
            pushback(Some(Duration::from_secs(86_400 * 30))),
            "2147483647"
        );
        assert_eq!(pushback(None), "-1");
    }

    #[test]
    fn a_resource_exhausted_answer_announces_its_pushback_and_retry_info() {
        let answer = |pairs: &[(&'static str, &str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.insert(*name, HeaderValue::from_str(value).unwrap());
            }
            announced_wait(&headers)
        };
        let wait = |ms| Some(Duration::from_millis(ms));
        assert_eq!(
            answer(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")]),
            wait(1500)
        );
        assert_eq!(
            answer(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "1500")]),
            None
        );
        assert_eq!(
            answer(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")]),
            None
        );
        assert_eq!(
            answer(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "soon")]),
            None
        );
        assert_eq!(answer(&[("grpc-retry-pushback-ms", "1500")]), None);
        assert_eq!(answer(&[("grpc-status", "8")]), None);
        // Garbage where base64 belongs is ignored, never a panic.
        assert_eq!(
            answer(&[("grpc-status", "8"), ("grpc-status-details-bin", "%%%")]),
            None
        );
        #[cfg(feature = "grpc")]
        {
            let details = details(8, "slow down", Some(Duration::from_secs(7)), &[]);
            let details = details.to_str().unwrap();
            let pairs = [("grpc-status", "8"), ("grpc-status-details-bin", details)];
            assert_eq!(answer(&pairs), wait(7000));
            // The longer of the two.
            let pairs = [
                ("grpc-status", "8"),
                ("grpc-retry-pushback-ms", "9000"),
                ("grpc-status-details-bin", details),
            ];
            assert_eq!(answer(&pairs), wait(9000));
            // Padded base64 too.
            let padded = format!("{details}{}", "=".repeat((4 - details.len() % 4) % 4));
            let pairs = [("grpc-status", "8"), ("grpc-status-details-bin", &padded)];
            assert_eq!(answer(&pairs), wait(7000));
        }
    }

    #[test]
    fn http_statuses_map_to_the_codes_google_rpc_pairs_them_with() {
        assert_eq!(code_of(StatusCode::TOO_MANY_REQUESTS), 8);
        assert_eq!(code_of(StatusCode::PAYLOAD_TOO_LARGE), 8);
        assert_eq!(code_of(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(code_of(StatusCode::FORBIDDEN), 7);
        assert_eq!(code_of(StatusCode::UNAUTHORIZED), 16);
        assert_eq!(code_of(StatusCode::BAD_REQUEST), 3);
        assert_eq!(code_of(StatusCode::INTERNAL_SERVER_ERROR), 13);
        assert_eq!(code_of(StatusCode::IM_A_TEAPOT), 2);
    }
}
