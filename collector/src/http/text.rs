//! Checks on text from a request before it reaches the store. Postgres
//! `TEXT` cannot hold a NUL character (the insert fails, which would read as
//! "storage unavailable"), and SQLite would keep it, so both refuse it here
//! with the field's name. Names, labels and ids are single lines: a control
//! character in one (an escape sequence, a line break in a log line) is
//! refused too; free text keeps its tabs and line breaks.

use super::api::ApiError;

/// The longest text field the API stores.
pub const MAX_TEXT_BYTES: usize = 1024;
/// The longest device id a path may carry (`[limits] max_id_len` bounds what
/// agents store).
pub const MAX_ID_BYTES: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lines {
    /// A name, label or id: no control characters at all.
    One,
    /// Free text (a comment): tabs and line breaks, no other control
    /// characters.
    Many,
}

/// Refuses `value` unless it is 1..=`max` bytes of non-blank text without
/// NUL or, per `lines`, other control characters.
pub fn check_text(field: &str, value: &str, lines: Lines, max: usize) -> Result<(), ApiError> {
    if value.trim().is_empty() || value.len() > max {
        return Err(ApiError::BadRequest(format!(
            "`{field}` must be 1..={max} bytes of text, not blank"
        )));
    }
    let refused = value.char_indices().find(|&(_, c)| match lines {
        Lines::One => c.is_control(),
        Lines::Many => c.is_control() && !matches!(c, '\t' | '\n' | '\r'),
    });
    match refused {
        None => Ok(()),
        Some((at, '\0')) => Err(ApiError::BadRequest(format!(
            "`{field}` contains a NUL character (byte {at}), which cannot be stored"
        ))),
        Some((at, c)) => Err(ApiError::BadRequest(format!(
            "`{field}` contains the control character U+{:04X} (byte {at}): {}",
            u32::from(c),
            match lines {
                Lines::One => "it must be a single line of printable text",
                Lines::Many => "only tabs and line breaks are allowed",
            }
        ))),
    }
}

/// A device id from a URL path, before it is looked up.
pub fn check_id(field: &str, value: &str) -> Result<(), ApiError> {
    check_text(field, value, Lines::One, MAX_ID_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(field: &str, value: &str, lines: Lines) -> Option<String> {
        match check_text(field, value, lines, MAX_TEXT_BYTES) {
            Ok(()) => None,
            Err(ApiError::BadRequest(m)) => Some(m),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn nul_is_refused_everywhere_and_control_characters_in_single_lines() {
        let nul = refusal("comment", "a\0b", Lines::Many).unwrap();
        assert!(nul.contains("`comment`") && nul.contains("NUL"), "{nul}");
        assert!(refusal("comment", "line one\nline\ttwo\r\n", Lines::Many).is_none());
        let bell = refusal("comment", "ding\u{7}", Lines::Many).unwrap();
        assert!(bell.contains("U+0007"), "{bell}");
        let newline = refusal("created_by", "ops\nroot", Lines::One).unwrap();
        assert!(
            newline.contains("`created_by`") && newline.contains("U+000A"),
            "{newline}"
        );
        assert!(refusal("created_by", "esc\u{1b}[31m", Lines::One).is_some());
        assert!(refusal("created_by", "c1\u{85}", Lines::One).is_some());
        assert!(refusal("created_by", "Zoë Müller", Lines::One).is_none());
        assert!(refusal("by", "  ", Lines::One).is_some());
        assert!(refusal("by", &"x".repeat(MAX_TEXT_BYTES + 1), Lines::One).is_some());
    }
}
