//! [`ConfigError`]: why a configuration was refused, naming the field and, for a file, its line
//! and column.

use std::fmt;

/// Why a configuration was refused. Its text names the field (`routes[2].rules[0].period`), says
/// what is wrong, and, for a file that was parsed here, where: `(line 9, column 24)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: String,
    message: String,
    location: Option<(usize, usize)>,
}

impl ConfigError {
    /// An error of the value at `field` (a path such as `routes[0].rules[1].limit`; empty for the
    /// whole file).
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            message: message.into(),
            location: None,
        }
    }

    /// The path of the bad field, such as `routes[0].rules[1].limit` (empty: the whole file).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with it.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The line and column (1-based) of the bad value in the file, when known.
    pub fn location(&self) -> Option<(usize, usize)> {
        self.location
    }

    /// Points the error at the byte range `span` of `text`, unless it already points somewhere.
    pub(crate) fn at_span(mut self, text: &str, span: Option<std::ops::Range<usize>>) -> Self {
        if self.location.is_none()
            && let Some(span) = span
        {
            self.location = Some(line_and_column(text, span.start));
        }
        self
    }

    /// Points the error at its field in the TOML `text` it was found in: the value, or for a
    /// missing field the table that lacks it. For an app's own checks of a file this crate read,
    /// so its errors name a line and column like the crate's.
    pub fn locate_in_toml(self, text: &str) -> Self {
        let span = toml_span(text, &self.field);
        self.at_span(text, span)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)?;
        if let Some((line, column)) = self.location {
            write!(f, " (line {line}, column {column})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// 1-based line and column (in characters) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |newline| newline + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// One step of a field path: a key, or an index into an array.
#[derive(Debug, PartialEq, Eq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// The steps of `routes[2].rules[0].period`; `None` for a path this module didn't write.
fn steps(path: &str) -> Option<Vec<Step<'_>>> {
    let mut steps = Vec::new();
    for part in path.split('.').filter(|part| !part.is_empty()) {
        let (key, mut indexes) = match part.find('[') {
            Some(at) => (&part[..at], &part[at..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            steps.push(Step::Key(key));
        }
        while let Some(rest) = indexes.strip_prefix('[') {
            let (index, after) = rest.split_once(']')?;
            steps.push(Step::Index(index.parse().ok()?));
            indexes = after;
        }
    }
    Some(steps)
}

/// The byte range of the value at `path` in the TOML `text`: the deepest part of the path that
/// exists (a missing field points at its table).
fn toml_span(text: &str, path: &str) -> Option<std::ops::Range<usize>> {
    use toml::de::{DeTable, DeValue};

    let document = DeTable::parse(text).ok()?;
    let steps = steps(path)?;
    let mut span = None;
    let mut table: Option<&DeTable> = Some(document.get_ref());
    let mut array: Option<&[toml::Spanned<DeValue>]> = None;
    for step in steps {
        let value = match (step, table, array) {
            (Step::Key(key), Some(current), _) => current.get(key),
            (Step::Index(index), _, Some(items)) => items.get(index),
            _ => None,
        };
        let Some(value) = value else { break };
        span = Some(value.span());
        (table, array) = match value.get_ref() {
            DeValue::Table(inner) => (Some(inner), None),
            DeValue::Array(items) => (None, Some(&items[..])),
            _ => (None, None),
        };
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_keys_and_indexes() {
        assert_eq!(
            steps("routes[2].rules[0].period").unwrap(),
            vec![
                Step::Key("routes"),
                Step::Index(2),
                Step::Key("rules"),
                Step::Index(0),
                Step::Key("period"),
            ]
        );
        assert_eq!(steps("").unwrap(), vec![]);
        assert!(steps("routes[x]").is_none());
    }

    #[test]
    fn an_error_points_at_its_value_or_the_table_that_lacks_it() {
        let text = "prefix = \"a\"\n\n[[routes]]\npath = \"/a\"\nrules = [{ limit = 1, period = \"1m\" }, { limit = 0, period = \"1h\" }]\n";
        let error =
            ConfigError::new("routes[0].rules[1].limit", "must be at least 1").locate_in_toml(text);
        assert_eq!(error.location(), Some((5, 50)));
        assert_eq!(
            error.to_string(),
            "routes[0].rules[1].limit: must be at least 1 (line 5, column 50)"
        );
        let missing = ConfigError::new("routes[0].rules[1].burst", "x").locate_in_toml(text);
        assert_eq!(missing.location(), Some((5, 40)), "the rule's table");
        let whole = ConfigError::new("", "empty").locate_in_toml(text);
        assert_eq!(
            (whole.location(), whole.to_string()),
            (None, "empty".into())
        );
    }

    #[test]
    fn columns_count_characters() {
        assert_eq!(line_and_column("é = 1\nab", 7), (2, 1));
        assert_eq!(line_and_column("é = 1", 2), (1, 2));
        assert_eq!(line_and_column("x", 99), (1, 2));
    }
}
