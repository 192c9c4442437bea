//! The structured mutations `proptest_parsers.rs` applies to valid inputs: JSON edits at a path
//! (a value replaced by null, another type, a huge or negative number, unicode, deep nesting;
//! a key removed or added) that say which paths they touched, and byte edits of the text (a byte
//! flipped, the text cut, bytes inserted).

use proptest::prelude::*;
use serde_json::Value;

/// Values that replace a JSON value: null, each other type, huge and negative numbers, unicode,
/// deep nesting.
fn hostile_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(serde_json::json!(0)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(1.5)),
        Just(serde_json::json!(-0.0)),
        Just(serde_json::json!(u32::MAX)),
        Just(serde_json::json!(u32::MAX as u64 + 1)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(1e308)),
        Just(serde_json::json!(65_537)),
        Just(serde_json::json!(1_048_577)),
        Just(serde_json::json!("")),
        Just(serde_json::json!("😀\u{202e}\u{1b}[31m\n")),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([1, 2, 3])),
        Just(serde_json::json!([null])),
        Just(serde_json::json!({"a": null})),
        (0u32..200).prop_map(|d| (0..d).fold(serde_json::json!(1), |v, _| serde_json::json!([v]))),
        any::<i64>().prop_map(|v| serde_json::json!(v)),
        any::<f64>()
            .prop_filter("finite", |v| v.is_finite())
            .prop_map(|v| serde_json::json!(v)),
        "\\PC{0,40}".prop_map(Value::String),
        (1usize..5000).prop_map(|n| Value::String("x".repeat(n))),
    ]
}

/// Text JSON cannot hold as a value, spliced in raw (numbers past f64, deep nesting, NaN).
fn raw_json_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("1e400".to_string()),
        Just("-1e400".to_string()),
        Just(format!("1{}", "0".repeat(400))),
        Just("NaN".to_string()),
        Just("Infinity".to_string()),
        Just("0.0000000000000000000000000000001".to_string()),
        Just("-0".to_string()),
        Just("01".to_string()),
        Just(format!("{}{}", "[".repeat(100_000), "]".repeat(100_000))),
        Just(format!("{}1{}", "{\"a\":".repeat(200), "}".repeat(200))),
    ]
}

#[derive(Debug, Clone)]
pub(crate) enum Edit {
    /// Replace the value at the `n`-th path (in document order) by this one.
    Set(usize, Value),
    /// Replace it by raw text.
    Raw(usize, String),
    /// Remove the key (or element) at the `n`-th path.
    Remove(usize),
    /// Add a key beside the `n`-th path.
    Add(usize, String, Value),
}

pub(crate) fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        5 => (any::<usize>(), hostile_json()).prop_map(|(n, v)| Edit::Set(n, v)),
        1 => (any::<usize>(), raw_json_value()).prop_map(|(n, v)| Edit::Raw(n, v)),
        2 => any::<usize>().prop_map(Edit::Remove),
        1 => (
            any::<usize>(),
            prop_oneof![
                Just("unknown_key".to_string()),
                Just("".to_string()),
                Just("😀".to_string()),
                "[a-z_]{1,12}"
            ],
            hostile_json()
        )
            .prop_map(|(n, k, v)| Edit::Add(n, k, v)),
    ]
}

/// Every path of a JSON value (object keys and array indices), in document order.
fn paths(v: &Value) -> Vec<Vec<String>> {
    fn walk(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    at.push(k.clone());
                    out.push(at.clone());
                    walk(x, at, out);
                    at.pop();
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    at.push(i.to_string());
                    out.push(at.clone());
                    walk(x, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

fn parent_mut<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path[..path.len() - 1].iter().try_fold(v, |o, k| match o {
        Value::Object(m) => m.get_mut(k),
        Value::Array(a) => a.get_mut(k.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Apply edits; returns the text and the top-level-relative paths that were edited.
pub(crate) fn apply(mut v: Value, edits: &[Edit]) -> (String, Vec<Vec<String>>) {
    let mut raws: Vec<String> = Vec::new();
    let mut touched = Vec::new();
    for e in edits {
        let ps = paths(&v);
        if ps.is_empty() {
            break;
        }
        let n = match e {
            Edit::Set(n, _) | Edit::Raw(n, _) | Edit::Remove(n) | Edit::Add(n, _, _) => *n,
        };
        let path = ps[n % ps.len()].clone();
        let key = path.last().unwrap().clone();
        let Some(parent) = parent_mut(&mut v, &path) else {
            continue;
        };
        match (e, parent) {
            (Edit::Set(_, x), Value::Object(m)) => {
                m.insert(key, x.clone());
            }
            (Edit::Set(_, x), Value::Array(a)) => a[key.parse::<usize>().unwrap()] = x.clone(),
            (Edit::Raw(_, raw), Value::Object(m)) => {
                m.insert(key, Value::String(format!("@@RAW{}@@", raws.len())));
                raws.push(raw.clone());
            }
            (Edit::Remove(_), Value::Object(m)) => {
                m.remove(&key);
            }
            (Edit::Remove(_), Value::Array(a)) => {
                a.remove(key.parse::<usize>().unwrap());
            }
            (Edit::Add(_, k, x), Value::Object(m)) => {
                m.insert(k.clone(), x.clone());
            }
            _ => continue,
        }
        touched.push(path);
    }
    let mut text = serde_json::to_string(&v).unwrap();
    for (i, raw) in raws.iter().enumerate() {
        text = text.replace(&format!("\"@@RAW{i}@@\""), raw);
    }
    (text, touched)
}

#[derive(Debug, Clone)]
pub(crate) enum ByteEdit {
    Truncate(usize),
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Repeat(usize, usize, u8),
    Bom,
}

pub(crate) fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        any::<usize>().prop_map(ByteEdit::Truncate),
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| ByteEdit::Flip(i, b)),
        (
            any::<usize>(),
            prop_oneof![
                Just(b"\x00".to_vec()),
                Just(b"\"".to_vec()),
                Just(b"\\".to_vec()),
                Just(b"\n".to_vec()),
                Just(b"\xc3".to_vec()),
                Just(b"\xff\xfe".to_vec()),
                Just("😀".as_bytes().to_vec()),
                prop::collection::vec(any::<u8>(), 1..16),
            ]
        )
            .prop_map(|(i, b)| ByteEdit::Insert(i, b)),
        (any::<usize>(), 1usize..64, 2u8..50).prop_map(|(i, n, k)| ByteEdit::Repeat(i, n, k)),
        Just(ByteEdit::Bom),
    ]
}

pub(crate) fn apply_bytes(mut b: Vec<u8>, edits: &[ByteEdit]) -> Vec<u8> {
    for e in edits {
        let len = b.len().max(1);
        match e {
            ByteEdit::Truncate(i) => b.truncate(i % len),
            ByteEdit::Flip(i, bit) => {
                if !b.is_empty() {
                    let i = i % b.len();
                    b[i] ^= 1 << bit;
                }
            }
            ByteEdit::Insert(i, x) => {
                let i = i % (b.len() + 1);
                b.splice(i..i, x.iter().copied());
            }
            ByteEdit::Repeat(i, n, k) => {
                if !b.is_empty() {
                    let i = i % b.len();
                    let j = (i + n).min(b.len());
                    let chunk = b[i..j].repeat(*k as usize);
                    b.splice(j..j, chunk);
                }
            }
            ByteEdit::Bom => b.splice(0..0, [0xef, 0xbb, 0xbf]).for_each(drop),
        }
    }
    b
}
