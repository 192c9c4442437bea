//! The reference on disk: a safetensors file written and read one tensor at a time, so neither
//! computing nor using a reference ever holds more than one of its tensors in memory.
//!
//! Layout (all f64, in this order in the data section): `grad/<name>` for each trained tensor,
//! then for t = 0..=K `param/<t>/<name>` (and `ema/<t>/<name>` when the recipe keeps an EMA),
//! then `drift/losses` (K) and `loss` (1). The header is written first: every shape is known
//! before the reference runs. Size: 8 B × N × (K + 2) (× (2K + 3)/(K + 2) with an EMA), N the
//! trained parameters, plus the header.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Mutex;

use super::error::{reference_error, Result};

/// Where each tensor lies in the data section.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub shape: Vec<usize>,
    pub start: u64,
    pub len: u64,
}

/// The keys of a reference in file order.
pub(crate) fn keys(
    names: &[(String, Vec<usize>)],
    steps: u32,
    ema: bool,
) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = names
        .iter()
        .map(|(n, s)| (format!("grad/{n}"), s.clone()))
        .collect();
    for t in 0..=steps {
        for (n, s) in names {
            out.push((format!("param/{t}/{n}"), s.clone()));
        }
        if ema {
            for (n, s) in names {
                out.push((format!("ema/{t}/{n}"), s.clone()));
            }
        }
    }
    out.push(("drift/losses".into(), vec![steps as usize]));
    out.push(("loss".into(), vec![1]));
    out
}

/// Bytes of a reference file's data section.
pub(crate) fn data_bytes(trained: u64, steps: u32, ema: bool) -> u64 {
    let per_step = if ema { 2 } else { 1 };
    8 * (trained * (1 + per_step * (u64::from(steps) + 1)) + u64::from(steps) + 1)
}

/// Bytes of the writer's buffer.
pub(crate) const WRITE_BUFFER: u64 = 1 << 20;

/// Streams a reference into a file, tensor by tensor, in the order of [`keys`].
/// The safetensors header of `meta` and tensors `order` (padded to 8 bytes) and the length of
/// the data it describes.
fn header(meta: &HashMap<String, String>, order: &[(String, Vec<usize>)]) -> Result<(String, u64)> {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::to_value(meta).map_err(|e| reference_error(e.to_string()))?,
    );
    let mut at = 0u64;
    for (k, shape) in order {
        let len = 8 * shape.iter().product::<usize>() as u64;
        header.insert(
            k.clone(),
            serde_json::json!({"dtype": "F64", "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut text = serde_json::to_string(&header).map_err(|e| reference_error(e.to_string()))?;
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    Ok((text, at))
}

/// The length of the file [`Writer`] writes for `meta` and `order`: 8 + header + data.
pub(crate) fn file_len(
    meta: &HashMap<String, String>,
    order: &[(String, Vec<usize>)],
) -> Result<u64> {
    let (text, data) = header(meta, order)?;
    Ok(8 + text.len() as u64 + data)
}

pub(crate) struct Writer {
    out: BufWriter<File>,
    order: Vec<(String, Vec<usize>)>,
    next: usize,
    /// What error messages call the file.
    name: String,
}

impl Writer {
    /// A new file at `path` (which must not exist), readable and writable.
    pub(super) fn create(
        path: &Path,
        meta: HashMap<String, String>,
        order: Vec<(String, Vec<usize>)>,
    ) -> Result<Writer> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| reference_error(format!("cannot create '{}': {e}", path.display())))?;
        Writer::on(file, format!("'{}'", path.display()), meta, order)
    }

    /// A file without a name in `dir` (removed from the directory as it is created): the
    /// system frees its blocks when the process ends, however it ends — a killed `verify`
    /// leaves no multi-gigabyte file behind.
    pub(super) fn anonymous(
        dir: &Path,
        meta: HashMap<String, String>,
        order: Vec<(String, Vec<usize>)>,
    ) -> Result<Writer> {
        let file = tempfile::tempfile_in(dir).map_err(|e| {
            reference_error(format!(
                "cannot create a temporary file in '{}': {e}",
                dir.display()
            ))
        })?;
        Writer::on(
            file,
            format!("the temporary reference in '{}'", dir.display()),
            meta,
            order,
        )
    }

    fn on(
        file: File,
        name: String,
        meta: HashMap<String, String>,
        order: Vec<(String, Vec<usize>)>,
    ) -> Result<Writer> {
        let (text, _) = header(&meta, &order)?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER as usize, file);
        let io = |e: std::io::Error| reference_error(format!("cannot write {name}: {e}"));
        out.write_all(&(text.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(text.as_bytes()).map_err(io)?;
        Ok(Writer {
            out,
            order,
            next: 0,
            name,
        })
    }

    /// Write the next tensor; `key` and the value count must be the ones the layout expects.
    pub(super) fn put(&mut self, key: &str, values: &[f64]) -> Result<()> {
        let (want, shape) = self
            .order
            .get(self.next)
            .ok_or_else(|| reference_error(format!("'{key}' written past the layout's end")))?;
        let n: usize = shape.iter().product();
        if want != key || n != values.len() {
            return Err(reference_error(format!(
                "'{key}' ({} values) written where the layout expects '{want}' ({n})",
                values.len()
            )));
        }
        self.next += 1;
        let mut buf = [0u8; 8 * 512];
        for chunk in values.chunks(512) {
            for (i, x) in chunk.iter().enumerate() {
                buf[8 * i..8 * i + 8].copy_from_slice(&x.to_le_bytes());
            }
            self.out
                .write_all(&buf[..8 * chunk.len()])
                .map_err(|e| reference_error(format!("cannot write {}: {e}", self.name)))?;
        }
        Ok(())
    }

    /// The written file, flushed.
    pub(super) fn finish(self) -> Result<File> {
        if self.next != self.order.len() {
            return Err(reference_error(format!(
                "{} of {} tensors written",
                self.next,
                self.order.len()
            )));
        }
        let name = self.name;
        self.out
            .into_inner()
            .map_err(|e| reference_error(format!("cannot write {name}: {}", e.error())))
    }
}

/// A reference file's header: its metadata and where each tensor lies.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layout {
    pub meta: HashMap<String, String>,
    pub entries: HashMap<String, Entry>,
    pub data_start: u64,
}

/// Read and check the header of a reference file: every tensor f64, its size its shape's, the
/// data section contiguous and exactly as long as the file.
pub(crate) fn read_layout(mut f: &File) -> Result<Layout> {
    f.seek(SeekFrom::Start(0))
        .map_err(|e| reference_error(format!("cannot read: {e}")))?;
    let file_len = f
        .metadata()
        .map_err(|e| reference_error(format!("cannot stat: {e}")))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| reference_error("not a safetensors file (shorter than its header length)"))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > file_len {
        return Err(reference_error(format!(
            "not a safetensors file (header of {n} B in a file of {file_len} B)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text)
        .map_err(|e| reference_error(format!("unreadable header ({e})")))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)
        .map_err(|e| reference_error(format!("not a safetensors file ({e})")))?;
    let mut meta = HashMap::new();
    let mut entries = HashMap::new();
    for (k, v) in header {
        if k == "__metadata__" {
            meta = serde_json::from_value(v)
                .map_err(|e| reference_error(format!("unreadable metadata ({e})")))?;
            continue;
        }
        let bad = || reference_error(format!("tensor '{k}' has an unreadable entry"));
        if v.get("dtype").and_then(|d| d.as_str()) != Some("F64") {
            return Err(reference_error(format!("tensor '{k}' is not f64")));
        }
        let shape: Vec<usize> =
            serde_json::from_value(v.get("shape").cloned().ok_or_else(bad)?).map_err(|_| bad())?;
        let off: [u64; 2] = serde_json::from_value(v.get("data_offsets").cloned().ok_or_else(bad)?)
            .map_err(|_| bad())?;
        let count = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(bad)?;
        if off[1] < off[0] || off[1] - off[0] != count.saturating_mul(8) {
            return Err(reference_error(format!(
                "tensor '{k}': offsets {off:?} do not hold shape {shape:?}"
            )));
        }
        entries.insert(
            k,
            Entry {
                shape,
                start: off[0],
                len: off[1] - off[0],
            },
        );
    }
    let mut spans: Vec<(u64, u64)> = entries.values().map(|e| (e.start, e.len)).collect();
    spans.sort_unstable();
    let mut at = 0;
    for (s, l) in spans {
        if s != at {
            return Err(reference_error("tensor data is not contiguous"));
        }
        at = s + l;
    }
    if 8 + n + at != file_len {
        return Err(reference_error(format!(
            "the file has {file_len} B; its header describes {} B (cut or padded)",
            8 + n + at
        )));
    }
    Ok(Layout {
        meta,
        entries,
        data_start: 8 + n,
    })
}

/// Reads tensors of a reference file by key. Workers share the one open file (a file without
/// a name can be opened only once); each read seeks and reads under its lock, a few
/// milliseconds beside a variant's step.
pub(crate) struct Reader<'a> {
    file: &'a Mutex<File>,
    layout: &'a Layout,
    bytes: Vec<u8>,
}

impl<'a> Reader<'a> {
    pub(super) fn new(file: &'a Mutex<File>, layout: &'a Layout) -> Reader<'a> {
        Reader {
            file,
            layout,
            bytes: Vec::new(),
        }
    }

    /// The values of `key` into `out` (resized).
    pub(crate) fn read_into(&mut self, key: &str, out: &mut Vec<f64>) -> Result<()> {
        let e = self
            .layout
            .entries
            .get(key)
            .ok_or_else(|| reference_error(format!("tensor '{key}' is missing")))?;
        self.bytes.resize(e.len as usize, 0);
        {
            let mut f = self
                .file
                .lock()
                .map_err(|_| reference_error("a reader of the reference panicked"))?;
            f.seek(SeekFrom::Start(self.layout.data_start + e.start))
                .and_then(|_| f.read_exact(&mut self.bytes))
                .map_err(|err| reference_error(format!("cannot read '{key}': {err}")))?;
        }
        out.clear();
        out.extend(
            self.bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
        );
        Ok(())
    }

    pub(super) fn read(&mut self, key: &str) -> Result<Vec<f64>> {
        let mut v = Vec::new();
        self.read_into(key, &mut v)?;
        Ok(v)
    }
}
