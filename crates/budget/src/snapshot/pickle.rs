//! A pickle, decoded with `serde-pickle` into a small tree of Python values whose size is
//! bounded: every value and every string byte counts against a budget, so a file whose memo
//! references expand (the same list referenced from many places, nested) is refused instead of
//! exhausting memory. The snapshot reader (`read.rs`) walks this tree.

use std::cell::Cell;
use std::fmt;

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::snapshot::SnapshotError;

/// A Python value of a memory snapshot: only builtin types occur there.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Py {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    /// A `bytes` object, by length (snapshots hold none; kept so that one is a type error).
    Bytes(usize),
    /// A list, tuple, set or frozenset.
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
}

impl Py {
    /// The Python type's name, for messages.
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Py::None => "None",
            Py::Bool(_) => "bool",
            Py::Int(_) => "int",
            Py::Float(_) => "float",
            Py::Str(_) => "str",
            Py::Bytes(_) => "bytes",
            Py::List(_) => "list",
            Py::Dict(_) => "dict",
        }
    }

    /// The value of a string key of a dict.
    pub(crate) fn get(&self, key: &str) -> Option<&Py> {
        match self {
            Py::Dict(kv) => kv
                .iter()
                .find(|(k, _)| matches!(k, Py::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Bytes of tree one value costs besides its string bytes (the enum and a slot in its parent).
const NODE_COST: u64 = 48;

/// Decode `bytes` as one pickle into a [`Py`] tree of at most `budget` bytes.
pub(crate) fn decode(bytes: &[u8], budget: u64) -> Result<Py, SnapshotError> {
    let left = Cell::new(budget);
    let mut de = serde_pickle::Deserializer::new(bytes, serde_pickle::DeOptions::new());
    let seed = Seed { left: &left };
    let value = seed.deserialize(&mut de);
    if left.get() == 0 {
        return Err(SnapshotError::TooLarge {
            what: "decoded values".into(),
            limit: format!("{} MiB", budget >> 20),
        });
    }
    let value = value.map_err(|e| SnapshotError::NotPickle {
        message: pickle_message(&e),
    })?;
    de.end().map_err(|e| SnapshotError::NotPickle {
        message: pickle_message(&e),
    })?;
    Ok(value)
}

/// `serde-pickle`'s message, on one line and bounded in length.
fn pickle_message(e: &serde_pickle::Error) -> String {
    let s = e.to_string().replace('\n', " ");
    let s: String = s.chars().take(200).collect();
    let eof = match e {
        serde_pickle::Error::Io(io) => io.kind() == std::io::ErrorKind::UnexpectedEof,
        _ => s.contains("EOF"),
    };
    if eof {
        format!("truncated: the pickle ends before its STOP opcode ({s})")
    } else {
        s
    }
}

struct Seed<'a> {
    left: &'a Cell<u64>,
}

impl Seed<'_> {
    fn take<E: serde::de::Error>(&self, cost: u64) -> Result<(), E> {
        let left = self.left.get();
        if cost > left {
            self.left.set(0);
            return Err(E::custom("over the decoding budget"));
        }
        self.left.set(left - cost);
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Py;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Py, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = Py;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Python value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::None)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Py, E> {
        self.visit_unit()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Py, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Int(v.into()))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Int(v.into()))
    }

    fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Int(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Float(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Py, E> {
        self.take(NODE_COST + v.len() as u64)?;
        Ok(Py::Str(v.to_string()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Py, E> {
        self.take(NODE_COST + v.len() as u64)?;
        Ok(Py::Str(v))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Bytes(v.len()))
    }

    fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Py, E> {
        self.take(NODE_COST)?;
        Ok(Py::Bytes(v.len()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Py, A::Error> {
        self.take(NODE_COST)?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Seed { left: self.left })? {
            out.push(v);
        }
        Ok(Py::List(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Py, A::Error> {
        self.take(NODE_COST)?;
        let mut out = Vec::new();
        while let Some(k) = map.next_key_seed(Seed { left: self.left })? {
            let v = map.next_value_seed(Seed { left: self.left })?;
            out.push((k, v));
        }
        Ok(Py::Dict(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_pickle::{HashableValue as H, SerOptions, Value as V};
    use std::collections::BTreeMap;

    fn pickle(v: &V) -> Vec<u8> {
        serde_pickle::value_to_vec(v, SerOptions::new()).unwrap()
    }

    #[test]
    fn decodes_builtin_types_with_large_ints() {
        let mut d = BTreeMap::new();
        d.insert(H::String("a".into()), V::I64(1 << 40));
        d.insert(H::String("t".into()), V::Tuple(vec![V::I64(0), V::I64(-3)]));
        d.insert(H::String("f".into()), V::F64(0.5));
        d.insert(H::String("n".into()), V::None);
        let p = decode(&pickle(&V::Dict(d)), 1 << 20).unwrap();
        assert_eq!(p.get("a"), Some(&Py::Int(1 << 40)));
        assert_eq!(p.get("t"), Some(&Py::List(vec![Py::Int(0), Py::Int(-3)])));
        assert_eq!(p.get("f"), Some(&Py::Float(0.5)));
        assert_eq!(p.get("n"), Some(&Py::None));
    }

    #[test]
    fn refuses_truncated_and_non_pickles() {
        let bytes = pickle(&V::List(vec![V::I64(1), V::String("x".into())]));
        let e = decode(&bytes[..bytes.len() - 3], 1 << 20).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let e = decode(b"segments,device_traces\n1,2\n", 1 << 20).unwrap_err();
        assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
    }

    /// One memoized list of 50,000 ints referenced 2,000 times (4 bytes each) would decode to
    /// 100 million values: the budget stops it.
    #[test]
    fn a_memo_bomb_stops_at_the_budget() {
        // Protocol 2: PROTO 2; [1]*50_000 memoized as 0 and popped; [m0]*2_000; STOP.
        let mut b = vec![0x80, 2, b']', b'q', 0, b'('];
        for _ in 0..50_000 {
            b.extend_from_slice(&[b'K', 1]);
        }
        b.extend_from_slice(&[b'e', b'0', b']', b'(']);
        for _ in 0..2_000 {
            b.extend_from_slice(&[b'h', 0]);
        }
        b.extend_from_slice(&[b'e', b'.']);
        let e = decode(&b, 64 << 20).unwrap_err();
        assert!(
            matches!(e, SnapshotError::TooLarge { .. }),
            "expected the budget to stop it: {e}"
        );
        // Within a budget large enough, the same bytes decode.
        let short = {
            let mut b = vec![
                0x80, 2, b']', b'q', 0, b'(', b'K', 1, b'e', b'0', b']', b'(',
            ];
            b.extend_from_slice(&[b'h', 0, b'h', 0, b'e', b'.']);
            b
        };
        let v = decode(&short, 1 << 20).unwrap();
        assert_eq!(v, Py::List(vec![Py::List(vec![Py::Int(1)]); 2]));
    }
}
