//! Settings written as one of a fixed list of names (`name()`): one reader and one error for all
//! of them, so that every such field refuses a word the same way ("'x' is not an optimizer;
//! allowed: adamw, adamw-8bit, sgd").

use crate::error::SpecError;

/// `s` read as the value of `all` whose `name` it is, or an error naming `field`, what a value
/// is (`what`: "an optimizer") and the allowed names in the order of `all`.
pub(crate) fn parse_named<T: Copy>(
    s: &str,
    all: &[T],
    name: fn(T) -> &'static str,
    field: &str,
    what: &str,
) -> Result<T, SpecError> {
    all.iter().copied().find(|v| name(*v) == s).ok_or_else(|| {
        let allowed: Vec<&str> = all.iter().map(|v| name(*v)).collect();
        SpecError::invalid(
            field,
            format!("'{s}' is not {what}; allowed: {}", allowed.join(", ")),
        )
    })
}

/// `s`, trimmed and in any case, read as the value of its spelling in `words` (each accepted
/// spelling, aliases included, and its value), or an error naming `field`, what a value is and
/// the `allowed` names (`s` shown to its first 60 characters).
pub(crate) fn parse_spelling<T: Copy>(
    s: &str,
    words: &[(&str, T)],
    field: &str,
    what: &str,
    allowed: &str,
) -> Result<T, SpecError> {
    let w = s.trim().to_ascii_lowercase();
    let found = words.iter().find(|(k, _)| *k == w).map(|&(_, v)| v);
    found.ok_or_else(|| {
        let shown: String = s.chars().take(60).collect();
        SpecError::invalid(
            field,
            format!("'{shown}' is not {what}; allowed: {allowed}"),
        )
    })
}

/// `FromStr` through [`parse_named`] for each listed type: `Type => "field", "what", [values]`
/// (the values in the order the error lists them).
macro_rules! from_name {
    ($($ty:ty => $field:literal, $what:literal, $all:expr;)+) => {$(
        impl std::str::FromStr for $ty {
            type Err = $crate::error::SpecError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $crate::named::parse_named(s, &$all, <$ty>::name, $field, $what)
            }
        }
    )+};
}
pub(crate) use from_name;

/// `From<T> for String` (its `Display`) and `TryFrom<String>` (its `FromStr`): the conversions
/// serde's `into = "String"` / `try_from = "String"` ask of a value written as text.
macro_rules! text_form {
    ($ty:ty) => {
        impl From<$ty> for String {
            fn from(v: $ty) -> String {
                v.to_string()
            }
        }

        impl TryFrom<String> for $ty {
            type Error = $crate::error::SpecError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                s.parse()
            }
        }
    };
}
pub(crate) use text_form;
