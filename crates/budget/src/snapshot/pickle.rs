//! A pickle of builtin Python values (protocols 0–5), decoded into a tree whose shared parts stay
//! shared.
//!
//! Why not `serde-pickle`: it resolves a memo reference by cloning the referenced value and
//! counts how often each may be used, so a value referenced from inside another shared value
//! runs out of uses and the file is refused as "recursive" — and a PyTorch snapshot is made of
//! exactly such values: `ivalue_symbolize` (`torch/csrc/cuda/memory_snapshot.cpp`) gives every
//! trace entry of one traceback the same `frames` list, whose frame dicts are shared too. Here
//! the memo holds node indices, so a shared list is one node however often it is referenced;
//! memory grows with the file (each opcode makes at most one node), bounded by [`MAX_NODES`].
//! Opcodes that build objects of classes (GLOBAL, REDUCE, BUILD, NEWOBJ, …) are refused: a
//! snapshot holds only dicts, lists, tuples, strings, ints, floats, bools and None.

use std::rc::Rc;

use crate::snapshot::SnapshotError;

/// Most values a pickle may hold: about 110 B each while read (node, stack, memo, tree), so at
/// most about 3 GiB of memory.
pub(crate) const MAX_NODES: usize = 25_000_000;
/// Deepest nesting of containers read (a snapshot nests five deep).
const MAX_DEPTH: usize = 64;

/// A Python value of a memory snapshot.
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
    List(Vec<Rc<Py>>),
    Dict(Vec<(Rc<Py>, Rc<Py>)>),
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
                .find(|(k, _)| matches!(&**k, Py::Str(s) if s == key))
                .map(|(_, v)| &**v),
            _ => None,
        }
    }
}

/// A value while the pickle is read: containers refer to other nodes by index.
#[derive(Debug, Clone)]
enum Node {
    Leaf(Py),
    List(Vec<u32>),
    Dict(Vec<(u32, u32)>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Item {
    Mark,
    Node(u32),
}

struct Vm<'a> {
    b: &'a [u8],
    pos: usize,
    nodes: Vec<Node>,
    stack: Vec<Item>,
    memo: std::collections::HashMap<u64, u32>,
}

fn bad(message: impl Into<String>) -> SnapshotError {
    SnapshotError::NotPickle {
        message: message.into(),
    }
}

impl<'a> Vm<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], SnapshotError> {
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= self.b.len() as u64);
        match end {
            Some(end) => {
                let s = &self.b[self.pos..end as usize];
                self.pos = end as usize;
                Ok(s)
            }
            None => Err(bad(format!(
                "truncated: the pickle ends inside an opcode's argument at byte {}",
                self.pos
            ))),
        }
    }

    fn uint(&mut self, n: u64) -> Result<u64, SnapshotError> {
        let s = self.take(n)?;
        Ok(s.iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64))
    }

    fn line(&mut self) -> Result<&'a str, SnapshotError> {
        let rest = &self.b[self.pos..];
        let n = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or_else(|| bad("truncated: a text argument has no end of line"))?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| bad("a text argument is not UTF-8"))?;
        self.pos += n + 1;
        Ok(s)
    }

    fn node(&mut self, n: Node) -> Result<u32, SnapshotError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(SnapshotError::TooLarge {
                what: "values in the pickle".into(),
                limit: format!("{MAX_NODES}"),
            });
        }
        self.nodes.push(n);
        Ok((self.nodes.len() - 1) as u32)
    }

    fn push_leaf(&mut self, p: Py) -> Result<(), SnapshotError> {
        let id = self.node(Node::Leaf(p))?;
        self.stack.push(Item::Node(id));
        Ok(())
    }

    fn pop(&mut self) -> Result<u32, SnapshotError> {
        match self.stack.pop() {
            Some(Item::Node(id)) => Ok(id),
            Some(Item::Mark) => Err(bad("a MARK where a value was expected")),
            None => Err(bad("the stack is empty where a value was expected")),
        }
    }

    fn top(&self) -> Result<u32, SnapshotError> {
        match self.stack.last() {
            Some(Item::Node(id)) => Ok(*id),
            _ => Err(bad("no value on the stack to memoize or add to")),
        }
    }

    /// The values above the topmost MARK (which is removed).
    fn pop_mark(&mut self) -> Result<Vec<u32>, SnapshotError> {
        let m = self
            .stack
            .iter()
            .rposition(|i| *i == Item::Mark)
            .ok_or_else(|| bad("no MARK on the stack"))?;
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .map(|i| match i {
                Item::Node(id) => id,
                Item::Mark => 0,
            })
            .collect())
    }

    fn append(&mut self, to: u32, items: &[u32]) -> Result<(), SnapshotError> {
        match &mut self.nodes[to as usize] {
            Node::List(v) => {
                v.extend_from_slice(items);
                Ok(())
            }
            _ => Err(bad(
                "APPEND(S) or ADDITEMS to a value that is not a list or set",
            )),
        }
    }

    fn set_items(&mut self, to: u32, items: &[u32]) -> Result<(), SnapshotError> {
        if !items.len().is_multiple_of(2) {
            return Err(bad("SETITEMS with an odd number of values"));
        }
        match &mut self.nodes[to as usize] {
            Node::Dict(v) => {
                for kv in items.chunks(2) {
                    v.push((kv[0], kv[1]));
                }
                Ok(())
            }
            _ => Err(bad("SETITEM(S) to a value that is not a dict")),
        }
    }

    fn memo_put(&mut self, key: u64) -> Result<(), SnapshotError> {
        let top = self.top()?;
        if self.memo.len() >= MAX_NODES {
            return Err(bad("too many memo entries"));
        }
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), SnapshotError> {
        let id = *self
            .memo
            .get(&key)
            .ok_or_else(|| bad(format!("memo entry {key} is used before it is set")))?;
        self.stack.push(Item::Node(id));
        Ok(())
    }

    fn long(bytes: &[u8]) -> Result<i128, SnapshotError> {
        if bytes.is_empty() {
            return Ok(0);
        }
        if bytes.len() > 16 {
            return Err(bad(format!(
                "an integer of {} bytes (at most 16 are read)",
                bytes.len()
            )));
        }
        let neg = bytes[bytes.len() - 1] & 0x80 != 0;
        let mut v: u128 = if neg { u128::MAX } else { 0 };
        for &x in bytes.iter().rev() {
            v = (v << 8) | x as u128;
        }
        Ok(v as i128)
    }

    fn string(&mut self, n: u64) -> Result<(), SnapshotError> {
        let s = self.take(n)?;
        let s = std::str::from_utf8(s).map_err(|_| bad("a string is not UTF-8"))?;
        self.push_leaf(Py::Str(s.to_string()))
    }

    /// Run to STOP; the root node. Each opcode goes to the first group that knows it.
    fn run(&mut self) -> Result<u32, SnapshotError> {
        loop {
            let at = self.pos;
            let op = *self
                .b
                .get(self.pos)
                .ok_or_else(|| bad("truncated: the pickle ends before its STOP opcode"))?;
            self.pos += 1;
            if op == b'.' {
                return self.pop();
            }
            let known = self.frame_op(op)?
                || self.leaf_op(op)?
                || self.container_op(op)?
                || self.memo_op(op)?;
            if !known {
                return Err(refused(op, at));
            }
        }
    }

    /// The protocol header, frame lengths, marks and the stack's own opcodes.
    fn frame_op(&mut self, op: u8) -> Result<bool, SnapshotError> {
        match op {
            0x80 => {
                let v = self.uint(1)?;
                if v > 5 {
                    return Err(bad(format!("pickle protocol {v} (0 … 5 are read)")));
                }
            }
            0x95 => {
                self.uint(8)?;
            }
            b'(' => self.stack.push(Item::Mark),
            b'0' => {
                self.stack
                    .pop()
                    .ok_or_else(|| bad("POP on an empty stack"))?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let t = self.top()?;
                self.stack.push(Item::Node(t));
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The opcodes that push a scalar, a string or a byte string.
    fn leaf_op(&mut self, op: u8) -> Result<bool, SnapshotError> {
        match op {
            b'N' => self.push_leaf(Py::None)?,
            0x88 => self.push_leaf(Py::Bool(true))?,
            0x89 => self.push_leaf(Py::Bool(false))?,
            b'K' => {
                let v = self.uint(1)?;
                self.push_leaf(Py::Int(v as i128))?
            }
            b'M' => {
                let v = self.uint(2)?;
                self.push_leaf(Py::Int(v as i128))?
            }
            b'J' => {
                let v = self.uint(4)? as u32 as i32;
                self.push_leaf(Py::Int(v as i128))?
            }
            // LONG1, LONG4: a 1- or 4-byte length, then the little-endian two's complement.
            0x8a | 0x8b => {
                let n = self.uint(if op == 0x8a { 1 } else { 4 })?;
                let v = Self::long(self.take(n)?)?;
                self.push_leaf(Py::Int(v))?
            }
            b'I' | b'L' => {
                let l = self.line()?.trim_end_matches('L');
                let p = match l {
                    "00" => Py::Bool(false),
                    "01" => Py::Bool(true),
                    _ => Py::Int(l.parse().map_err(|_| {
                        bad(format!(
                            "'{}' is not an integer",
                            l.chars().take(40).collect::<String>()
                        ))
                    })?),
                };
                self.push_leaf(p)?
            }
            b'G' => {
                let s = self.take(8)?;
                let mut a = [0u8; 8];
                a.copy_from_slice(s);
                self.push_leaf(Py::Float(f64::from_be_bytes(a)))?
            }
            b'F' => {
                let l = self.line()?;
                let v = l.parse().map_err(|_| bad("a FLOAT that is not a number"))?;
                self.push_leaf(Py::Float(v))?
            }
            // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 and Python 2 str (SHORT_BINSTRING,
            // BINSTRING: bytes read as text when they are UTF-8): a 1-, 4- or 8-byte length.
            0x8c | b'X' | 0x8d | b'U' | b'T' => {
                let n = self.uint(match op {
                    0x8c | b'U' => 1,
                    0x8d => 8,
                    _ => 4,
                })?;
                self.string(n)?
            }
            // Protocol 0 str: raw-unicode-escape on one line.
            b'V' => {
                let rest = &self.b[self.pos..];
                let n = rest
                    .iter()
                    .position(|&c| c == b'\n')
                    .ok_or_else(|| bad("truncated: a text argument has no end of line"))?;
                let text = raw_unicode_escape(&rest[..n])?;
                self.pos += n + 1;
                self.push_leaf(Py::Str(text))?
            }
            b'C' | b'B' | 0x8e | 0x96 => {
                let n = match op {
                    b'C' => self.uint(1)?,
                    b'B' => self.uint(4)?,
                    _ => self.uint(8)?,
                };
                self.take(n)?;
                self.push_leaf(Py::Bytes(n as usize))?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The opcodes that make or fill a list, tuple or dict.
    fn container_op(&mut self, op: u8) -> Result<bool, SnapshotError> {
        match op {
            b']' | 0x8f => {
                let id = self.node(Node::List(Vec::new()))?;
                self.stack.push(Item::Node(id));
            }
            b')' => {
                let id = self.node(Node::List(Vec::new()))?;
                self.stack.push(Item::Node(id));
            }
            b'}' => {
                let id = self.node(Node::Dict(Vec::new()))?;
                self.stack.push(Item::Node(id));
            }
            b'l' | b't' | 0x91 => {
                let items = self.pop_mark()?;
                let id = self.node(Node::List(items))?;
                self.stack.push(Item::Node(id));
            }
            b'd' => {
                let items = self.pop_mark()?;
                let id = self.node(Node::Dict(Vec::new()))?;
                self.set_items(id, &items)?;
                self.stack.push(Item::Node(id));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                let id = self.node(Node::List(items))?;
                self.stack.push(Item::Node(id));
            }
            b'a' => {
                let v = self.pop()?;
                let to = self.top()?;
                self.append(to, &[v])?
            }
            b'e' | 0x90 => {
                let items = self.pop_mark()?;
                let to = self.top()?;
                self.append(to, &items)?
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                let to = self.top()?;
                self.set_items(to, &[k, v])?
            }
            b'u' => {
                let items = self.pop_mark()?;
                let to = self.top()?;
                self.set_items(to, &items)?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The memo's PUT and GET opcodes.
    fn memo_op(&mut self, op: u8) -> Result<bool, SnapshotError> {
        match op {
            0x94 | b'q' | b'r' | b'p' => {
                let k = self.memo_index(op)?;
                self.memo_put(k)?
            }
            b'h' | b'j' | b'g' => {
                let k = self.memo_index(op)?;
                self.memo_get(k)?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The memo index a PUT or GET opcode names: the next free one (MEMOIZE), a 1-byte
    /// (BINPUT, BINGET) or 4-byte (LONG_BINPUT, LONG_BINGET) argument, or a decimal line (PUT,
    /// GET).
    fn memo_index(&mut self, op: u8) -> Result<u64, SnapshotError> {
        match op {
            0x94 => Ok(self.memo.len() as u64),
            b'q' | b'h' => self.uint(1),
            b'r' | b'j' => self.uint(4),
            _ => {
                let what = if op == b'p' { "PUT" } else { "GET" };
                self.line()?
                    .parse()
                    .map_err(|_| bad(format!("a {what} index that is not a number")))
            }
        }
    }

    /// The tree under `id`, shared nodes converted once.
    fn convert(
        &self,
        id: u32,
        done: &mut Vec<Option<Rc<Py>>>,
        depth: usize,
    ) -> Result<Rc<Py>, SnapshotError> {
        if let Some(p) = &done[id as usize] {
            return Ok(p.clone());
        }
        if depth > MAX_DEPTH {
            return Err(bad(format!(
                "values nested more than {MAX_DEPTH} deep (or a container that holds itself)"
            )));
        }
        let p = match &self.nodes[id as usize] {
            Node::Leaf(p) => Rc::new(p.clone()),
            Node::List(v) => {
                let mut out = Vec::with_capacity(v.len());
                for &c in v {
                    out.push(self.convert(c, done, depth + 1)?);
                }
                Rc::new(Py::List(out))
            }
            Node::Dict(v) => {
                let mut out = Vec::with_capacity(v.len());
                for &(k, x) in v {
                    out.push((
                        self.convert(k, done, depth + 1)?,
                        self.convert(x, done, depth + 1)?,
                    ));
                }
                Rc::new(Py::Dict(out))
            }
        };
        done[id as usize] = Some(p.clone());
        Ok(p)
    }
}

/// Python's `raw-unicode-escape`: `\uXXXX` and `\UXXXXXXXX` escapes, other bytes Latin-1.
fn raw_unicode_escape(b: &[u8]) -> Result<String, SnapshotError> {
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let n = match (b[i], b.get(i + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            _ => 0,
        };
        if n > 0 && i + 2 + n <= b.len() {
            let hex = std::str::from_utf8(&b[i + 2..i + 2 + n]).ok();
            let c = hex
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .and_then(char::from_u32)
                .ok_or_else(|| bad("a bad \\u escape in a protocol-0 string"))?;
            out.push(c);
            i += 2 + n;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    Ok(out)
}

/// Decode `bytes` as one pickle.
pub(crate) fn decode(bytes: &[u8]) -> Result<Rc<Py>, SnapshotError> {
    let mut vm = Vm {
        b: bytes,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: std::collections::HashMap::new(),
    };
    let root = vm.run()?;
    if vm.pos != bytes.len() {
        return Err(bad(format!(
            "{} bytes follow the STOP opcode",
            bytes.len() - vm.pos
        )));
    }
    let mut done = vec![None; vm.nodes.len()];
    vm.convert(root, &mut done, 0)
}

/// The error for an opcode the reader does not run: one that builds an object of a class (a
/// memory snapshot holds only builtin types), or one it does not know.
fn refused(op: u8, at: usize) -> SnapshotError {
    match op {
        b'c' | 0x93 | b'R' | b'b' | 0x81 | 0x92 | b'i' | b'o' | b'P' | b'Q' | 0x82..=0x84 | 0x97
        | 0x98 => bad(format!(
            "opcode 0x{op:02x} at byte {at} builds a Python object of a class; a memory snapshot              holds only builtin types"
        )),
        _ => bad(format!("unknown opcode 0x{op:02x} at byte {at}")),
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
        d.insert(H::String("m".into()), V::I64(-(1 << 40)));
        d.insert(H::String("t".into()), V::Tuple(vec![V::I64(0), V::I64(-3)]));
        d.insert(H::String("f".into()), V::F64(0.5));
        d.insert(H::String("n".into()), V::None);
        d.insert(H::String("b".into()), V::Bool(true));
        let p = decode(&pickle(&V::Dict(d))).unwrap();
        assert_eq!(p.get("a"), Some(&Py::Int(1 << 40)));
        assert_eq!(p.get("m"), Some(&Py::Int(-(1 << 40))));
        assert_eq!(
            p.get("t"),
            Some(&Py::List(vec![Rc::new(Py::Int(0)), Rc::new(Py::Int(-3))]))
        );
        assert_eq!(p.get("f"), Some(&Py::Float(0.5)));
        assert_eq!(p.get("n"), Some(&Py::None));
        assert_eq!(p.get("b"), Some(&Py::Bool(true)));
    }

    #[test]
    fn refuses_truncated_and_non_pickles() {
        let bytes = pickle(&V::List(vec![V::I64(1), V::String("x".into())]));
        for cut in 1..bytes.len() {
            let e = decode(&bytes[..cut]).unwrap_err();
            assert!(
                e.to_string().contains("truncated") || e.to_string().contains("stack"),
                "{cut}: {e}"
            );
        }
        let e = decode(b"segments,device_traces\n1,2\n").unwrap_err();
        assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
        // A class instance (GLOBAL + REDUCE) is refused.
        let e = decode(b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.")
            .unwrap_err();
        assert!(e.to_string().contains("builtin types"), "{e}");
    }

    /// A list memoized once and referenced 2,000 times, holding a shared dict: one node each,
    /// and every reference sees the same values (serde-pickle refuses this shape).
    #[test]
    fn shared_values_stay_shared() {
        // PROTO 2; [ {"k": 1} ] memoized as 0 and popped; [m0] * 2_000; STOP.
        let mut b = vec![
            0x80, 2, b']', b'q', 0, b'(', b'}', b'q', 1, 0x8c, 1, b'k', b'K', 1, b's', b'e', b'0',
            b']', b'(',
        ];
        for _ in 0..2_000 {
            b.extend_from_slice(&[b'h', 0]);
        }
        b.extend_from_slice(b"e.");
        let v = decode(&b).unwrap();
        let Py::List(outer) = &*v else {
            panic!("{v:?}")
        };
        assert_eq!(outer.len(), 2_000);
        assert!(Rc::ptr_eq(&outer[0], &outer[1999]));
        let Py::List(inner) = &*outer[1999] else {
            panic!()
        };
        assert_eq!(inner[0].get("k"), Some(&Py::Int(1)));
    }

    /// A list that holds itself is refused, not followed forever.
    #[test]
    fn a_cycle_is_refused() {
        let b = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
        let e = decode(&b).unwrap_err();
        assert!(e.to_string().contains("nested"), "{e}");
    }
}
