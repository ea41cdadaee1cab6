//! [`StatusSet`]: the HTTP statuses a `count_only` policy counts, as config files and the derive
//! write them: codes (`401`) and classes (`"4xx"`).

use std::fmt;

/// A set of HTTP statuses: whole codes and classes.
///
/// ```
/// use tower_redis_ratelimit_spec::StatusSet;
///
/// let mut failures = StatusSet::default();
/// failures.insert_code(401).unwrap();
/// failures.insert_written("5xx").unwrap();
/// assert!(failures.contains(401) && failures.contains(503));
/// assert!(!failures.contains(200) && !failures.contains(403));
/// assert!(failures.insert_written("6xx").is_err());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusSet {
    codes: Vec<u16>,
    /// Bit `n` for the class `nxx` (1 to 5).
    classes: u8,
}

/// Why a status can't be in a [`StatusSet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidStatus(String);

impl fmt::Display for InvalidStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is not an HTTP status: write a code from 100 to 599 (401) or a class \
             (\"1xx\" to \"5xx\")",
            self.0
        )
    }
}

impl std::error::Error for InvalidStatus {}

impl StatusSet {
    /// Adds the status `code`.
    ///
    /// # Errors
    ///
    /// When `code` is not from 100 to 599.
    pub fn insert_code(&mut self, code: i64) -> Result<(), InvalidStatus> {
        match u16::try_from(code) {
            Ok(code @ 100..=599) => {
                if !self.codes.contains(&code) {
                    self.codes.push(code);
                }
                Ok(())
            }
            _ => Err(InvalidStatus(code.to_string())),
        }
    }

    /// Adds a status as a string writes it: a class (`"4xx"`, any case) or a code (`"401"`).
    ///
    /// # Errors
    ///
    /// When `text` is neither.
    pub fn insert_written(&mut self, text: &str) -> Result<(), InvalidStatus> {
        let invalid = || InvalidStatus(format!("{text:?}"));
        let bytes = text.as_bytes();
        if let [class @ b'1'..=b'5', x, y] = bytes
            && x.eq_ignore_ascii_case(&b'x')
            && y.eq_ignore_ascii_case(&b'x')
        {
            self.classes |= 1 << (class - b'0');
            return Ok(());
        }
        let code = text.parse::<i64>().map_err(|_| invalid())?;
        self.insert_code(code).map_err(|_| invalid())
    }

    /// Whether `status` is in the set.
    pub fn contains(&self, status: u16) -> bool {
        let class = status / 100;
        (class <= 5 && self.classes & (1 << class) != 0) || self.codes.contains(&status)
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.codes.is_empty() && self.classes == 0
    }
}

impl fmt::Display for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let classes = (1..=5u8)
            .filter(|class| self.classes & (1 << class) != 0)
            .map(|class| format!("\"{class}xx\""));
        let codes = self.codes.iter().map(u16::to_string);
        let items: Vec<String> = classes.chain(codes).collect();
        write!(f, "[{}]", items.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_classes_are_read_as_written() {
        let mut set = StatusSet::default();
        set.insert_written("4XX").unwrap();
        set.insert_code(503).unwrap();
        set.insert_written("201").unwrap();
        assert!(set.contains(404) && set.contains(499) && set.contains(503) && set.contains(201));
        assert!(!set.contains(500) && !set.contains(200) && !set.contains(999));
        assert_eq!(set.to_string(), "[\"4xx\", 503, 201]");
        for bad in ["6xx", "0xx", "4x", "40", "abc", "", "1000"] {
            assert!(set.insert_written(bad).is_err(), "{bad}");
        }
        for bad in [99, 600, -1, 70_000] {
            assert!(set.insert_code(bad).is_err(), "{bad}");
        }
        assert!(StatusSet::default().is_empty() && !set.is_empty());
    }
}
