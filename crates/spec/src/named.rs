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
