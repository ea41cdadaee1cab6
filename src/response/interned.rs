//! Values fixed per policy (its `RateLimit-Policy` header, its ready 429 bodies) as static bytes.
//! A clone of a shared `Bytes` writes its reference count, and under load every core writes the
//! same count at each response (a clone, then a drop): one cache line bouncing between cores. A
//! static one is copied without a write, and without the allocation a private copy would take.
//! Each distinct value is kept once for the life of the process, so rebuilding the same policies
//! (a reload) adds nothing; past [`MAX_INTERNED_BYTES`] in all, values stay shared instead.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use http::HeaderValue;

/// The most bytes kept for the life of the process: room for thousands of policies' headers and
/// bodies, and a bound for an app that builds policies without end.
const MAX_INTERNED_BYTES: usize = 1 << 20;

/// The values kept, and their bytes in all.
static INTERNED: Mutex<(BTreeSet<&'static [u8]>, usize)> = Mutex::new((BTreeSet::new(), 0));

/// `bytes` as static bytes, kept once per distinct value; `None` past the bound.
fn interned(bytes: &[u8]) -> Option<&'static [u8]> {
    let mut interned = INTERNED.lock().unwrap_or_else(PoisonError::into_inner);
    let (values, total) = &mut *interned;
    if let Some(kept) = values.get(bytes) {
        return Some(kept);
    }
    if *total + bytes.len() > MAX_INTERNED_BYTES {
        return None;
    }
    let kept: &'static [u8] = Box::leak(bytes.to_vec().into_boxed_slice());
    values.insert(kept);
    *total += kept.len();
    Some(kept)
}

/// `value` over static bytes (or `value` itself past the bound).
pub(super) fn static_header(value: &HeaderValue) -> HeaderValue {
    interned(value.as_bytes())
        .and_then(|kept| HeaderValue::from_maybe_shared(Bytes::from_static(kept)).ok())
        .unwrap_or_else(|| value.clone())
}

/// `body` as static bytes (or `body` itself past the bound).
pub(super) fn static_bytes(body: Bytes) -> Bytes {
    match interned(&body) {
        Some(kept) => Bytes::from_static(kept),
        None => body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_are_kept_once_and_read_back_whole() {
        let value = HeaderValue::from_static("\"interned-test\";q=5;w=60");
        let first = static_header(&HeaderValue::from_bytes(value.as_bytes()).unwrap());
        let second = static_header(&HeaderValue::from_bytes(value.as_bytes()).unwrap());
        assert_eq!(first, value);
        assert_eq!(first.as_bytes().as_ptr(), second.as_bytes().as_ptr());
        let body = static_bytes(Bytes::from(vec![b'{', b'}']));
        assert_eq!(&body[..], b"{}");
    }
}
