//! `torch.save` files (torchvision's pretrained `.pth` weights) read without
//! running anything from the file.
//!
//! A `torch.save` file (torch >= 1.6) is a zip archive `<name>/data.pkl`
//! (a pickle of the state_dict), `<name>/data/<key>` (one raw storage per
//! key), `<name>/version` and `<name>/byteorder`. The legacy format (torch <
//! 1.6, `_use_new_zipfile_serialization=False`) is a stream of pickles
//! (magic number, protocol, system info, the state_dict, the storage keys)
//! followed by the storages, each an i64 element count and its bytes.
//!
//! A pickle is a program for a stack machine, and its `GLOBAL` opcode names
//! any importable Python callable, which `REDUCE` then calls: unpickling an
//! untrusted file with Python's `pickle` runs arbitrary code. This module
//! does not run a pickle; it decodes one into values. It implements only the
//! opcodes a state_dict needs, accepts `GLOBAL` only for the names in
//! [`ALLOWED_GLOBALS`] (each one is interpreted here, by name), and refuses
//! any other global with an error naming it: there is no code to execute.
//!
//! Tensors are rebuilt from storage, offset, size and stride (strided views
//! are gathered) into the same [`RawTensor`]s the safetensors reader makes:
//! float, half and bfloat16 and double storages become F32 (double rounded
//! to f32), long storages I64. This module knows nothing of models.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{Cursor, Read};
use std::rc::Rc;

use crate::error::{Error, Result};
use crate::io::{RawData, RawTensor};

/// The globals a pickled state_dict may name, as `module.name`. Anything
/// else (`os.system`, `builtins.eval`, a model class of `torch.save(model)`)
/// is refused.
pub const ALLOWED_GLOBALS: [&str; 9] = [
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_parameter",
    "torch.FloatStorage",
    "torch.HalfStorage",
    "torch.BFloat16Storage",
    "torch.DoubleStorage",
    "torch.LongStorage",
];

/// The pickled magic number that starts a legacy `torch.save` file:
/// PROTO 2, LONG1 of 10 bytes, 0x1950a86a20f9469cfc6c little-endian.
const LEGACY_MAGIC: [u8; 14] = [
    0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19,
];
const LEGACY_MAGIC_NUMBER: i128 = 0x1950a86a20f9469cfc6c;
const LEGACY_PROTOCOL: i128 = 1001;
/// A data.pkl larger than this is not a state_dict of a ResNet.
const MAX_PICKLE_BYTES: u64 = 256 << 20;

/// How a file is written, judged by its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A zip archive (`torch.save` since torch 1.6).
    Zip,
    /// A pickle stream: legacy `torch.save` when it starts with torch's
    /// magic number, else some other pickle.
    Pickle,
}

/// `Some` when `bytes` are a `torch.save` file (or a pickle), `None` for
/// anything else (safetensors). A safetensors file starts with an 8-byte
/// header length and then `{`; a zip's byte 8 is its compression method and
/// a pickle's is an opcode argument, so the two cannot be confused.
pub fn sniff(bytes: &[u8]) -> Option<Format> {
    if bytes.get(8) == Some(&b'{') {
        return None;
    }
    if bytes.starts_with(b"PK\x03\x04") {
        Some(Format::Zip)
    } else if bytes.len() > 1 && bytes[0] == 0x80 && (2..=5).contains(&bytes[1]) {
        Some(Format::Pickle)
    } else {
        None
    }
}

/// The tensors of a `torch.save` state_dict in `bytes` (read from `path`,
/// which only names the file in errors).
pub fn read(path: &str, bytes: &[u8]) -> Result<BTreeMap<String, RawTensor>> {
    let bad = |reason: String| Error::BadWeights {
        path: path.to_string(),
        reason,
    };
    match sniff(bytes) {
        Some(Format::Zip) => read_zip(bytes).map_err(bad),
        Some(Format::Pickle) => read_legacy(bytes).map_err(bad),
        None => Err(bad("not a torch.save file".into())),
    }
}

// ---------------------------------------------------------------------------
// Containers
// ---------------------------------------------------------------------------

fn read_zip(bytes: &[u8]) -> std::result::Result<BTreeMap<String, RawTensor>, String> {
    let corrupt = |e: zip::result::ZipError| {
        format!("not a valid torch.save zip archive (truncated or corrupt?): {e}")
    };
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(corrupt)?;
    // The entries sit in one folder, named after the file when it was saved
    // ("archive/" or "resnet50-0676ba61/"): find it by its data.pkl.
    let pkl_names: Vec<String> = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .collect();
    let pkl_name = match &pkl_names[..] {
        [one] => one.clone(),
        [] => {
            return Err("a zip archive without '<name>/data.pkl': not a torch.save file".into());
        }
        _ => {
            return Err(format!(
                "a zip archive with several data.pkl: {pkl_names:?}"
            ));
        }
    };
    let prefix = &pkl_name[..pkl_name.len() - "data.pkl".len()];
    let mut read_entry = |name: &str, limit: u64| -> std::result::Result<Vec<u8>, String> {
        let entry = zip
            .by_name(name)
            .map_err(|e| format!("archive entry '{name}': {e}"))?;
        let mut out = Vec::new();
        entry
            .take(limit)
            .read_to_end(&mut out)
            .map_err(|e| format!("archive entry '{name}' (truncated or corrupt?): {e}"))?;
        Ok(out)
    };
    let little = match read_entry(&format!("{prefix}byteorder"), 16) {
        Ok(order) => match &order[..] {
            b"little" => true,
            b"big" => false,
            other => {
                return Err(format!(
                    "unknown byte order '{}' in {prefix}byteorder",
                    String::from_utf8_lossy(other)
                ));
            }
        },
        // Files from torch < 1.10 have none: they are little-endian.
        Err(_) => true,
    };
    let pickle = read_entry(&pkl_name, MAX_PICKLE_BYTES + 1)?;
    if pickle.len() as u64 > MAX_PICKLE_BYTES {
        return Err(format!(
            "{pkl_name} is larger than {MAX_PICKLE_BYTES} bytes"
        ));
    }
    let mut u = Unpickler::new(&pickle, 0);
    u.load().map_err(|e| format!("{pkl_name}: {e}"))?;
    let root = u.result.take().ok_or("empty pickle")?;
    let storages = u.storages;
    let mut data = BTreeMap::new();
    for (key, s) in &storages {
        let want = s.numel.checked_mul(s.dtype.size() as u64);
        let want = want.ok_or_else(|| format!("storage '{key}' is impossibly large"))?;
        let name = format!("{prefix}data/{key}");
        // One byte more than expected, so the reader reaches the entry's
        // end and checks its CRC.
        let raw = read_entry(&name, want.saturating_add(1))?;
        if raw.len() as u64 != want {
            return Err(format!(
                "archive entry '{name}' holds {} bytes, its tensors say {want}",
                raw.len()
            ));
        }
        data.insert(key.clone(), raw);
    }
    build(root, &storages, &data, little)
}

fn read_legacy(bytes: &[u8]) -> std::result::Result<BTreeMap<String, RawTensor>, String> {
    if !bytes.starts_with(&LEGACY_MAGIC) {
        return Err("a Python pickle that is not a torch.save file (no torch magic number)".into());
    }
    let mut pos = 0;
    let next = |what: &str, pos: &mut usize| -> std::result::Result<Unpickler<'_>, String> {
        let mut u = Unpickler::new(bytes, *pos);
        u.load()
            .map_err(|e| format!("legacy torch.save file, {what}: {e}"))?;
        *pos = u.pos;
        Ok(u)
    };
    let magic = next("magic number", &mut pos)?.result;
    if !matches!(magic, Some(Value::Int(LEGACY_MAGIC_NUMBER))) {
        return Err("bad legacy torch.save magic number".into());
    }
    let protocol = next("protocol version", &mut pos)?.result;
    if !matches!(protocol, Some(Value::Int(LEGACY_PROTOCOL))) {
        return Err(format!(
            "legacy torch.save protocol {} (only {LEGACY_PROTOCOL} is known)",
            protocol.map_or("?".into(), |v| v.describe())
        ));
    }
    let sys_info = next("system info", &mut pos)?.result;
    let little = match sys_info.as_ref().and_then(|v| v.dict_get("little_endian")) {
        Some(Value::Bool(b)) => b,
        _ => {
            return Err("legacy torch.save file without 'little_endian' in its system info".into());
        }
    };
    let mut main = next("state_dict", &mut pos)?;
    let root = main.result.take().ok_or("empty pickle")?;
    let storages = std::mem::take(&mut main.storages);
    let keys = next("storage keys", &mut pos)?.result;
    let keys: Vec<String> = match &keys {
        Some(Value::List(l)) => l
            .borrow()
            .iter()
            .map(|k| match k {
                Value::Str(s) => Ok(s.to_string()),
                other => Err(format!("storage key is {}", other.describe())),
            })
            .collect::<std::result::Result<_, _>>()?,
        _ => return Err("legacy torch.save file without its list of storage keys".into()),
    };
    let mut data = BTreeMap::new();
    for key in keys {
        let s = storages
            .get(&key)
            .ok_or_else(|| format!("storage '{key}' is listed but never used"))?;
        let header = bytes
            .get(pos..pos + 8)
            .ok_or_else(|| format!("storage '{key}' is missing (truncated file?)"))?;
        let header: [u8; 8] = header.try_into().expect("8 bytes");
        let numel = if little {
            i64::from_le_bytes(header)
        } else {
            i64::from_be_bytes(header)
        };
        if numel as u64 != s.numel {
            return Err(format!(
                "storage '{key}' holds {numel} elements, its tensor says {}",
                s.numel
            ));
        }
        pos += 8;
        let len = usize::try_from(s.numel)
            .ok()
            .and_then(|n| n.checked_mul(s.dtype.size()))
            .ok_or_else(|| format!("storage '{key}' is impossibly large"))?;
        let raw = bytes
            .get(pos..pos.saturating_add(len))
            .ok_or_else(|| format!("storage '{key}' is cut short (truncated file?)"))?;
        pos += len;
        data.insert(key, raw.to_vec());
    }
    build(root, &storages, &data, little)
}

// ---------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------

/// Element type of a storage, from its torch class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    F32,
    F16,
    BF16,
    F64,
    I64,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }
}

/// An allowed global, interpreted here by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensor,
    RebuildParameter,
    Storage(Dtype),
}

impl Global {
    fn by_name(module: &str, name: &str) -> Option<Self> {
        Some(match (module, name) {
            ("collections", "OrderedDict") => Global::OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
            ("torch._utils", "_rebuild_tensor") => Global::RebuildTensor,
            ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
            ("torch", "FloatStorage") => Global::Storage(Dtype::F32),
            ("torch", "HalfStorage") => Global::Storage(Dtype::F16),
            ("torch", "BFloat16Storage") => Global::Storage(Dtype::BF16),
            ("torch", "DoubleStorage") => Global::Storage(Dtype::F64),
            ("torch", "LongStorage") => Global::Storage(Dtype::I64),
            _ => return None,
        })
    }
}

/// A storage a tensor points into: its persistent id, decoded.
#[derive(Clone, Debug)]
struct StorageRef {
    key: Rc<str>,
    dtype: Dtype,
    numel: u64,
}

/// A tensor as pickled: a view into a storage.
#[derive(Clone, Debug)]
struct TensorRef {
    storage: Rc<StorageRef>,
    offset: u64,
    size: Vec<u64>,
    stride: Vec<i64>,
}

type Shared<T> = Rc<RefCell<T>>;

/// A decoded pickle value. Lists and dicts are shared, as in Python, so a
/// memo reference costs nothing and a hostile pickle cannot make copies grow.
#[derive(Clone, Debug)]
enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<[Value]>),
    List(Shared<Vec<Value>>),
    /// Insertion order; a later duplicate key wins, as in Python.
    Dict(Shared<Vec<(Value, Value)>>),
    Global(Global),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
}

impl Value {
    /// What it is, for messages (never its contents: a dict may hold itself).
    fn describe(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(b) => format!("the bool {b}"),
            Value::Int(i) => format!("the int {i}"),
            Value::Float(f) => format!("the float {f}"),
            Value::Str(s) => format!("the string {:?}", truncate(s)),
            Value::Bytes(b) => format!("{} bytes", b.len()),
            Value::Tuple(t) => format!("a tuple of {}", t.len()),
            Value::List(l) => format!("a list of {}", l.borrow().len()),
            Value::Dict(d) => format!("a dict of {} entries", d.borrow().len()),
            Value::Global(g) => format!("the global {g:?}"),
            Value::Storage(_) => "a storage".into(),
            Value::Tensor(_) => "a tensor".into(),
        }
    }

    fn dict_get(&self, key: &str) -> Option<Value> {
        let Value::Dict(d) = self else { return None };
        let d = d.borrow();
        d.iter()
            .rev()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
            .map(|(_, v)| v.clone())
    }

    fn int(&self, what: &str) -> std::result::Result<i128, String> {
        match self {
            Value::Int(i) => Ok(*i),
            Value::Bool(b) => Ok(*b as i128),
            other => Err(format!("{what} is {}, expected an int", other.describe())),
        }
    }

    fn ints(&self, what: &str) -> std::result::Result<Vec<i128>, String> {
        match self {
            Value::Tuple(t) => t.iter().map(|v| v.int(what)).collect(),
            Value::List(l) => l.borrow().iter().map(|v| v.int(what)).collect(),
            other => Err(format!("{what} is {}, expected a tuple", other.describe())),
        }
    }
}

/// Dropping a value takes its children out first and drops them one by one,
/// so a hostile pickle of a million nested lists cannot overflow the stack
/// through recursive drops. (Shared children are only released; cycles,
/// which a pickle can make, leak, bounded by the file's size.)
impl Drop for Value {
    fn drop(&mut self) {
        let mut work = Vec::new();
        take_children(self, &mut work);
        while let Some(mut v) = work.pop() {
            take_children(&mut v, &mut work);
        }
    }
}

fn take_children(v: &mut Value, work: &mut Vec<Value>) {
    match v {
        Value::Tuple(t) => {
            if let Some(items) = Rc::get_mut(t) {
                work.extend(items.iter_mut().map(|x| std::mem::replace(x, Value::None)));
            }
        }
        Value::List(l) => {
            if let Some(items) = Rc::get_mut(l) {
                work.append(items.get_mut());
            }
        }
        Value::Dict(d) => {
            if let Some(items) = Rc::get_mut(d) {
                for (k, v) in items.get_mut().drain(..) {
                    work.push(k);
                    work.push(v);
                }
            }
        }
        _ => {}
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(60).collect::<String>())
    } else {
        s.to_string()
    }
}

// ---------------------------------------------------------------------------
// The unpickler
// ---------------------------------------------------------------------------

struct Unpickler<'a> {
    bytes: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: BTreeMap<u32, Value>,
    /// Every storage a persistent id named, by key.
    storages: BTreeMap<String, Rc<StorageRef>>,
    result: Option<Value>,
}

type PResult<T> = std::result::Result<T, String>;

impl<'a> Unpickler<'a> {
    fn new(bytes: &'a [u8], pos: usize) -> Self {
        Unpickler {
            bytes,
            pos,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: BTreeMap::new(),
            storages: BTreeMap::new(),
            result: None,
        }
    }

    fn take(&mut self, n: usize) -> PResult<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| format!("pickle cut short at byte {}", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> PResult<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> PResult<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }

    fn u32(&mut self) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    fn len(&mut self, n: u64) -> PResult<usize> {
        usize::try_from(n).map_err(|_| format!("length {n} too large"))
    }

    fn line(&mut self) -> PResult<&'a str> {
        let rest = &self.bytes[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| format!("unterminated GLOBAL at byte {}", self.pos))?;
        let s = std::str::from_utf8(&rest[..end]).map_err(|_| "GLOBAL name is not UTF-8")?;
        self.pos += end + 1;
        Ok(s)
    }

    fn string(&mut self, n: usize) -> PResult<Value> {
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|_| "string is not UTF-8".to_string())?;
        Ok(Value::Str(s.into()))
    }

    fn pop(&mut self) -> PResult<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(format!("stack underflow at byte {}", self.pos));
        }
        Ok(self.stack.pop().expect("checked"))
    }

    fn top(&mut self) -> PResult<&mut Value> {
        let pos = self.pos;
        self.stack
            .last_mut()
            .ok_or_else(|| format!("stack underflow at byte {pos}"))
    }

    /// Everything above the last MARK, removing the mark.
    fn pop_mark(&mut self) -> PResult<Vec<Value>> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| format!("no MARK before byte {}", self.pos))?;
        Ok(self.stack.split_off(mark))
    }

    fn memo_put(&mut self, key: u32) -> PResult<()> {
        let v = self.top()?.clone();
        self.memo.insert(key, v);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> PResult<()> {
        let v = self
            .memo
            .get(&key)
            .cloned()
            .ok_or_else(|| format!("memo key {key} not defined"))?;
        self.stack.push(v);
        Ok(())
    }

    fn set_items(&mut self, items: Vec<Value>) -> PResult<()> {
        if !items.len().is_multiple_of(2) {
            return Err("SETITEMS with an odd number of values".into());
        }
        let Value::Dict(d) = self.top()? else {
            return Err("SETITEM(S) on something that is not a dict".into());
        };
        let d = d.clone();
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.borrow_mut().push((k, v));
        }
        Ok(())
    }

    fn append(&mut self, items: Vec<Value>) -> PResult<()> {
        let Value::List(l) = self.top()? else {
            return Err("APPEND(S) on something that is not a list".into());
        };
        l.borrow_mut().extend(items);
        Ok(())
    }

    /// Decodes one pickle, up to and including its STOP; the value is in
    /// `self.result`, the position after STOP in `self.pos`.
    fn load(&mut self) -> PResult<()> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    // PROTO
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(format!("pickle protocol {p} (at most 5 is known)"));
                    }
                }
                0x95 => {
                    // FRAME (protocol 4): a length prefix, nothing to do.
                    self.u64()?;
                }
                b'.' => {
                    // STOP
                    let v = self.pop()?;
                    self.result = Some(v);
                    return Ok(());
                }
                b'(' => self.marks.push(self.stack.len()),
                b'}' => self
                    .stack
                    .push(Value::Dict(Rc::new(RefCell::new(Vec::new())))),
                b']' => self
                    .stack
                    .push(Value::List(Rc::new(RefCell::new(Vec::new())))),
                b')' => self.stack.push(Value::Tuple(Rc::new([]))),
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.take(4)?.try_into().expect("4"));
                    self.stack.push(Value::Int(v as i128));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Value::Int(v as i128));
                }
                b'M' => {
                    let v = self.u16()?;
                    self.stack.push(Value::Int(v as i128));
                }
                0x8a => {
                    // LONG1: n bytes of two's complement, little-endian.
                    let n = self.u8()? as usize;
                    if n > 16 {
                        return Err(format!("integer of {n} bytes at byte {at}"));
                    }
                    let raw = self.take(n)?;
                    let mut buf = if raw.last().is_some_and(|b| b & 0x80 != 0) {
                        [0xffu8; 16]
                    } else {
                        [0u8; 16]
                    };
                    buf[..n].copy_from_slice(raw);
                    self.stack.push(Value::Int(i128::from_le_bytes(buf)));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().expect("8"));
                    self.stack.push(Value::Float(v));
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let v = self.string(n)?;
                    self.stack.push(v);
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    let v = self.string(n)?;
                    self.stack.push(v);
                }
                0x8d => {
                    let n = self.u64()?;
                    let n = self.len(n)?;
                    let v = self.string(n)?;
                    self.stack.push(v);
                }
                b'B' | b'C' | 0x8e => {
                    // BINBYTES, SHORT_BINBYTES, BINBYTES8
                    let n = match op {
                        b'B' => self.u32()? as u64,
                        b'C' => self.u8()? as u64,
                        _ => self.u64()?,
                    };
                    let n = self.len(n)?;
                    let raw = self.take(n)?;
                    self.stack.push(Value::Bytes(raw.into()));
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(items.into()));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() < floor + n {
                        return Err(format!("stack underflow at byte {at}"));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(items.into()));
                }
                b'l' => {
                    // LIST
                    let items = self.pop_mark()?;
                    self.stack.push(Value::List(Rc::new(RefCell::new(items))));
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                b'q' => {
                    let k = self.u8()? as u32;
                    self.memo_put(k)?;
                }
                b'r' => {
                    let k = self.u32()?;
                    self.memo_put(k)?;
                }
                0x94 => {
                    // MEMOIZE
                    let k = u32::try_from(self.memo.len()).map_err(|_| "memo too large")?;
                    self.memo_put(k)?;
                }
                b'h' => {
                    let k = self.u8()? as u32;
                    self.memo_get(k)?;
                }
                b'j' => {
                    let k = self.u32()?;
                    self.memo_get(k)?;
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module, name)?;
                }
                0x93 => {
                    // STACK_GLOBAL (protocol 4)
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (&module, &name) {
                        (Value::Str(m), Value::Str(n)) => {
                            let (m, n) = (m.clone(), n.clone());
                            self.global(&m, &n)?;
                        }
                        _ => return Err("STACK_GLOBAL of non-strings".into()),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.reduce(callable, args)?;
                    self.stack.push(v);
                }
                b'b' => {
                    // BUILD: sets attributes from a state. torch pickles a
                    // state_dict's `_metadata` (module versions) this way;
                    // only a dict may receive it, and it is dropped.
                    let state = self.pop()?;
                    match (self.top()?, &state) {
                        (Value::Dict(_), Value::Dict(_) | Value::None) => {}
                        (obj, _) => {
                            return Err(format!(
                                "BUILD of {} on {} at byte {at}",
                                state.describe(),
                                obj.describe()
                            ));
                        }
                    }
                }
                b'Q' => {
                    // BINPERSID
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.stack.push(v);
                }
                _ => {
                    return Err(format!(
                        "unsupported pickle opcode 0x{op:02x} at byte {at} (a state_dict \
                         never needs it)"
                    ));
                }
            }
        }
    }

    fn global(&mut self, module: &str, name: &str) -> PResult<()> {
        match Global::by_name(module, name) {
            Some(g) => {
                self.stack.push(Value::Global(g));
                Ok(())
            }
            None => {
                let mut msg = format!(
                    "refused: its pickle names the global '{module}.{name}', which a state_dict \
                     never needs (nothing from the file was run; allowed: {})",
                    ALLOWED_GLOBALS.join(", ")
                );
                // A class other than a storage: likely torch.save(model).
                let is_class = name.chars().next().is_some_and(char::is_uppercase);
                if is_class && !name.ends_with("Storage") {
                    msg.push_str(
                        "; if the file was written by torch.save(model), save \
                         model.state_dict() instead",
                    );
                }
                Err(msg)
            }
        }
    }

    /// Interprets a call of an allowed global.
    fn reduce(&mut self, callable: Value, args: Value) -> PResult<Value> {
        let Value::Global(g) = callable else {
            return Err(format!("REDUCE calls {}", callable.describe()));
        };
        let Value::Tuple(args) = &args else {
            return Err(format!("REDUCE of {g:?} with {}", args.describe()));
        };
        match (g, &args[..]) {
            (Global::OrderedDict, []) => Ok(Value::Dict(Rc::new(RefCell::new(Vec::new())))),
            // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
            // backward_hooks[, metadata]); _rebuild_tensor(storage, offset,
            // size, stride).
            (Global::RebuildTensorV2, [storage, offset, size, stride, _, _, ..])
            | (Global::RebuildTensor, [storage, offset, size, stride]) => {
                let Value::Storage(storage) = storage else {
                    return Err(format!(
                        "a tensor is rebuilt from {}, not a storage",
                        storage.describe()
                    ));
                };
                let offset = offset.int("a tensor's storage offset")?;
                let size = size.ints("a tensor's size")?;
                let stride = stride.ints("a tensor's stride")?;
                if size.len() != stride.len() {
                    return Err(format!("a tensor with size {size:?} and stride {stride:?}"));
                }
                let nonneg = |v: i128, what: &str| {
                    u64::try_from(v).map_err(|_| format!("a tensor's {what} is {v}"))
                };
                let stride = stride
                    .iter()
                    .map(|&s| i64::try_from(s).map_err(|_| format!("a tensor's stride is {s}")))
                    .collect::<PResult<Vec<_>>>()?;
                Ok(Value::Tensor(Rc::new(TensorRef {
                    storage: storage.clone(),
                    offset: nonneg(offset, "storage offset")?,
                    size: size
                        .iter()
                        .map(|&s| nonneg(s, "size"))
                        .collect::<PResult<_>>()?,
                    stride,
                })))
            }
            // _rebuild_parameter(data, requires_grad, backward_hooks)
            (Global::RebuildParameter, [Value::Tensor(t), _, _]) => Ok(Value::Tensor(t.clone())),
            _ => Err(format!(
                "{g:?} called with ({})",
                args.iter()
                    .map(Value::describe)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// `('storage', <storage class>, key, location, numel[, view])`.
    fn persistent_load(&mut self, pid: Value) -> PResult<Value> {
        let Value::Tuple(t) = &pid else {
            return Err(format!("persistent id is {}", pid.describe()));
        };
        let (kind, class, key, numel, view) = match &t[..] {
            [k, c, key, _location, n] => (k, c, key, n, None),
            [k, c, key, _location, n, view] => (k, c, key, n, Some(view)),
            _ => return Err(format!("persistent id is a tuple of {}", t.len())),
        };
        if !matches!(kind, Value::Str(s) if &**s == "storage") {
            return Err(format!("persistent id of kind {}", kind.describe()));
        }
        let Value::Global(Global::Storage(dtype)) = class else {
            return Err(format!("a storage of type {}", class.describe()));
        };
        let Value::Str(key) = key else {
            return Err(format!("a storage key is {}", key.describe()));
        };
        if let Some(view) = view
            && !matches!(view, Value::None)
        {
            return Err("a storage view (torch < 0.4): re-save the file with torch >= 1.6".into());
        }
        let numel = u64::try_from(numel.int("a storage's size")?)
            .map_err(|_| "a storage of negative size".to_string())?;
        let s = Rc::new(StorageRef {
            key: key.clone(),
            dtype: *dtype,
            numel,
        });
        if let Some(old) = self.storages.get(&**key)
            && (old.dtype != s.dtype || old.numel != s.numel)
        {
            return Err(format!("storage '{key}' is named with two types or sizes"));
        }
        self.storages.insert(key.to_string(), s.clone());
        Ok(Value::Storage(s))
    }
}

// ---------------------------------------------------------------------------
// From values to tensors
// ---------------------------------------------------------------------------

fn build(
    root: Value,
    storages: &BTreeMap<String, Rc<StorageRef>>,
    data: &BTreeMap<String, Vec<u8>>,
    little: bool,
) -> std::result::Result<BTreeMap<String, RawTensor>, String> {
    let Value::Dict(entries) = &root else {
        return Err(format!(
            "its pickle holds {}, not a state_dict (a dict of tensors)",
            root.describe()
        ));
    };
    // A dict among the values: a checkpoint holding a state_dict.
    if let Some((Value::Str(k), _)) = entries
        .borrow()
        .iter()
        .find(|(_, v)| matches!(v, Value::Dict(_)))
    {
        return Err(format!(
            "a dict of dicts ('{k}' is a dict), not a state_dict: is it a training \
             checkpoint? Save the model's state_dict alone, e.g. \
             torch.save(ckpt['{k}'], 'weights.pth')"
        ));
    }
    let mut out = BTreeMap::new();
    for (k, v) in entries.borrow().iter() {
        let Value::Str(name) = k else {
            return Err(format!("a state_dict key is {}", k.describe()));
        };
        let Value::Tensor(t) = v else {
            return Err(format!(
                "'{name}' holds {}, not a tensor: not a state_dict",
                v.describe()
            ));
        };
        debug_assert!(storages.contains_key(&*t.storage.key));
        let raw = data
            .get(&*t.storage.key)
            .ok_or_else(|| format!("'{name}': storage '{}' is missing", t.storage.key))?;
        let tensor = gather(t, raw, little).map_err(|e| format!("'{name}': {e}"))?;
        out.insert(name.to_string(), tensor);
    }
    Ok(out)
}

/// The elements of view `t` of storage bytes `raw`, in row-major order.
fn gather(t: &TensorRef, raw: &[u8], little: bool) -> std::result::Result<RawTensor, String> {
    let dtype = t.storage.dtype;
    let storage_numel = (raw.len() / dtype.size()) as u64;
    let numel = t
        .size
        .iter()
        .try_fold(1u64, |a, &s| a.checked_mul(s))
        .ok_or("size overflows")?;
    let shape: Vec<usize> = t
        .size
        .iter()
        .map(|&s| usize::try_from(s).map_err(|_| "size overflows".to_string()))
        .collect::<std::result::Result<_, _>>()?;
    let mut index = Vec::new();
    if numel > 0 {
        // A state_dict tensor never holds more elements than its storage
        // (that would be an expanded view): refusing it bounds allocation.
        if numel > storage_numel {
            return Err(format!(
                "size {:?} has {numel} elements, more than its storage's {storage_numel}",
                t.size
            ));
        }
        // Strides fit i64 and sizes u64, so each product fits i128.
        let mut last = Some(t.offset as i128);
        for (&s, &st) in t.size.iter().zip(&t.stride) {
            if st < 0 {
                return Err(format!("negative stride {:?}", t.stride));
            }
            last = last.and_then(|l| l.checked_add((s as i128 - 1) * st as i128));
        }
        let last = last.ok_or("offset and strides overflow")?;
        if last >= storage_numel as i128 {
            return Err(format!(
                "offset {} size {:?} stride {:?} reach past its storage of {storage_numel} elements",
                t.offset, t.size, t.stride
            ));
        }
        // Row-major walk of the view; a contiguous one is a plain range.
        index.reserve(numel as usize);
        let mut pos = vec![0u64; t.size.len()];
        let mut at = t.offset as i128;
        for _ in 0..numel {
            index.push(at as usize);
            for d in (0..pos.len()).rev() {
                pos[d] += 1;
                at += t.stride[d] as i128;
                if pos[d] < t.size[d] {
                    break;
                }
                at -= t.stride[d] as i128 * t.size[d] as i128;
                pos[d] = 0;
            }
        }
    }
    let el = |i: usize, n: usize| &raw[i * n..(i + 1) * n];
    macro_rules! arr {
        ($i:expr, $n:literal) => {{
            let mut b: [u8; $n] = el($i, $n).try_into().expect("size");
            if !little {
                b.reverse();
            }
            b
        }};
    }
    let data = match dtype {
        Dtype::F32 => RawData::F32(
            index
                .iter()
                .map(|&i| f32::from_le_bytes(arr!(i, 4)))
                .collect(),
        ),
        Dtype::F16 => RawData::F32(
            index
                .iter()
                .map(|&i| half::f16::from_le_bytes(arr!(i, 2)).to_f32())
                .collect(),
        ),
        Dtype::BF16 => RawData::F32(
            index
                .iter()
                .map(|&i| half::bf16::from_le_bytes(arr!(i, 2)).to_f32())
                .collect(),
        ),
        Dtype::F64 => RawData::F32(
            index
                .iter()
                .map(|&i| f64::from_le_bytes(arr!(i, 8)) as f32)
                .collect(),
        ),
        Dtype::I64 => RawData::I64(
            index
                .iter()
                .map(|&i| i64::from_le_bytes(arr!(i, 8)))
                .collect(),
        ),
    };
    Ok(RawTensor { shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pickle that calls os.system is refused at its GLOBAL.
    #[test]
    fn foreign_global_is_refused() {
        let pkl = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR.";
        let err = Unpickler::new(pkl, 0).load().unwrap_err();
        assert!(err.contains("'os.system'"), "{err}");
    }

    #[test]
    fn strided_views_are_gathered() {
        // storage 0..6 as f32; view (3, 2) with stride (1, 3): a transpose.
        let raw: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let t = TensorRef {
            storage: Rc::new(StorageRef {
                key: "0".into(),
                dtype: Dtype::F32,
                numel: 6,
            }),
            offset: 0,
            size: vec![3, 2],
            stride: vec![1, 3],
        };
        let r = gather(&t, &raw, true).unwrap();
        let RawData::F32(v) = r.data else { panic!() };
        assert_eq!(v, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let past = TensorRef {
            offset: 1,
            ..t.clone()
        };
        assert!(gather(&past, &raw, true).unwrap_err().contains("past"));
    }

    /// A million nested lists: an error (not a state_dict), not a stack
    /// overflow when the values are dropped.
    #[test]
    fn deep_nesting_does_not_overflow_the_stack() {
        let n = 1_000_000;
        let mut pkl = vec![0x80, 0x02];
        pkl.extend(std::iter::repeat_n(b']', n));
        pkl.extend(std::iter::repeat_n(b'a', n - 1));
        pkl.push(b'.');
        let mut u = Unpickler::new(&pkl, 0);
        u.load().unwrap();
        let root = u.result.take().unwrap();
        let err = build(root, &BTreeMap::new(), &BTreeMap::new(), true).unwrap_err();
        assert!(err.contains("not a state_dict"), "{err}");
        // Left on the stack too.
        let mut pkl = vec![0x80, 0x02, b'('];
        pkl.extend(std::iter::repeat_n(b']', n));
        pkl.extend(std::iter::repeat_n(b'a', n - 1));
        let _ = Unpickler::new(&pkl, 0).load();
    }

    #[test]
    fn garbage_never_panics() {
        // Every prefix of a real-looking pickle, and some byte noise.
        let pkl = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00aK\x01u.";
        for n in 0..pkl.len() {
            let _ = Unpickler::new(&pkl[..n], 0).load();
        }
        let mut x = 12345u64;
        for _ in 0..2000 {
            let bytes: Vec<u8> = (0..40)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 56) as u8
                })
                .collect();
            let _ = Unpickler::new(&bytes, 0).load();
            let _ = read("noise", &bytes);
        }
    }
}
