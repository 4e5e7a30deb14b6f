//! PTX text to decoded kernels.

use std::collections::HashMap;
use std::fmt;

/// Special registers, in the order they sit at the end of a thread's
/// register file: %tid.{x,y,z}, %ntid, %ctaid, %nctaid.
pub(crate) const SPECIALS: u32 = 12;
/// Placeholder index bases used while a function is parsed (its register
/// count is not known until its end); fixed up afterwards.
const CONST_BASE: u32 = 1 << 30;
const SPEC_BASE: u32 = 1 << 29;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fw {
    F32,
    F64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rnd {
    /// Round float to nearest even (`.rn`, or an exact conversion).
    Rn,
    /// Round to integer: nearest even, toward zero, down, up.
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cvt {
    /// Integer to integer: extend from `from` bits (signed or not), keep `to` bits.
    II { from: u8, signed: bool, to: u8 },
    /// Integer (`from` bits, signed or not) to a float of `to` (16, 32, 64) bits.
    IF { from: u8, signed: bool, to: u8 },
    /// Float (16/32/64 bits) to an integer of `to` bits, saturating.
    FI {
        from: u8,
        to: u8,
        signed: bool,
        rnd: Rnd,
    },
    /// Float to float.
    FF { from: u8, to: u8, rnd: Rnd },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    Global,
    Shared,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    // Integer ops on `w` bits (16, 32, 64); `s`: signed.
    Add(u8),
    Sub(u8),
    MulLo(u8),
    MulHi(u8, bool),
    MulWide(u8, bool),
    MadLo(u8),
    MadWide(u8, bool),
    Div(u8, bool),
    Rem(u8, bool),
    Min(u8, bool),
    Max(u8, bool),
    Neg(u8),
    Abs(u8),
    And(u8),
    Or(u8),
    Xor(u8),
    Not(u8),
    Shl(u8),
    Shr(u8, bool),
    PNot,
    // Floating point.
    FAdd(Fw),
    FSub(Fw),
    FMul(Fw),
    FDiv(Fw),
    Fma(Fw),
    Sqrt(Fw),
    Rcp(Fw),
    RcpApproxFtz64,
    FAbs(Fw),
    FNeg(Fw),
    FMin(Fw),
    FMax(Fw),
    Cvt(Cvt),
    SetpI(Cmp, u8, bool),
    SetpF(Cmp, Fw),
    /// d = c ? a : b
    Selp,
    Mov,
    /// d = a | b << half (halves of `half` bits).
    Pack(u8),
    /// d = low half of b, a = high half of b.
    Unpack(u8),
    Prmt,
    /// Bit-field insert (`bfi.b{w}`): d = b with the `len` bits from `pos`
    /// replaced by the low bits of a; pos = c, len = the register at imm
    /// (the one instruction with four sources).
    Bfi(u8),
    /// Bit-field extract (`bfe.{u,s}{w}`): d = the `len` (c) bits of a from
    /// `pos` (b), zero- or sign-extended.
    Bfe(u8, bool),
    /// Load `size` bytes at [a + imm], sign-extended when `signed`.
    Ld(Space, u8, bool),
    /// Store the low `size` bytes of b at [a + imm].
    St(Space, u8),
    /// Load from the parameter block at imm.
    LdParam(u8, bool),
    /// Jump to instruction imm.
    Bra,
    Bar,
    Ret,
}

/// One decoded instruction. Source operands are register indices (constants
/// and special registers live in the register file too); `g` is the guard
/// predicate's register (the constant 1 when unguarded), run when its low
/// bit equals `gv`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Inst {
    pub op: Op,
    pub g: u32,
    pub gv: u64,
    pub d: u32,
    pub a: u32,
    pub b: u32,
    pub c: u32,
    pub imm: i64,
}

/// A kernel parameter: its size in bytes and alignment (what
/// `cuLaunchKernel` reads from each `kernelParams` pointer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub bytes: usize,
    pub align: usize,
}

/// One decoded `.entry`.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub(crate) name: String,
    pub(crate) params: Vec<Param>,
    /// Offset of each parameter in the parameter block.
    pub(crate) param_offsets: Vec<usize>,
    pub(crate) param_block: usize,
    pub(crate) insts: Vec<Inst>,
    /// (line, text) of each instruction, for faults.
    pub(crate) src: Vec<(usize, String)>,
    /// Registers: declared ones, then constants, then the special registers.
    pub(crate) nregs: u32,
    pub(crate) consts: Vec<u64>,
    pub(crate) static_shared: usize,
    /// Where dynamic shared memory starts (aligned end of the static part).
    pub(crate) dynamic_offset: usize,
    pub(crate) max_threads: Option<u32>,
    pub(crate) req_threads: Option<[u32; 3]>,
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Each parameter's size in bytes and alignment, in order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }
    /// Bytes of static shared memory (the module's and the kernel's).
    pub fn static_shared_bytes(&self) -> usize {
        self.static_shared
    }
    /// Decoded instruction count.
    pub fn instruction_count(&self) -> usize {
        self.insts.len()
    }
    /// Registers per thread (declared, constants and special registers).
    pub fn register_file_len(&self) -> usize {
        self.nregs as usize + self.consts.len() + SPECIALS as usize
    }
    /// `.maxntid` (as a thread count) and `.reqntid`, when the kernel gives them.
    pub fn max_threads(&self) -> Option<u32> {
        self.max_threads
    }
    pub fn required_block(&self) -> Option<[u32; 3]> {
        self.req_threads
    }
}

/// A parsed PTX module: its kernels by name.
#[derive(Clone, Debug)]
pub struct Module {
    kernels: Vec<Kernel>,
}

impl Module {
    /// Parses NVRTC's PTX. Refuses any instruction or directive not
    /// supported, naming it and its line.
    pub fn parse(ptx: &str) -> Result<Module, ParseError> {
        Parser::default().module(ptx)
    }
    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }
    pub fn kernel_names(&self) -> Vec<&str> {
        self.kernels.iter().map(|k| k.name.as_str()).collect()
    }
}

/// Why a module was refused: the line (1-based), the statement, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub statement: String,
    pub what: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PTX line {} `{}`: {}",
            self.line, self.statement, self.what
        )
    }
}

impl std::error::Error for ParseError {}

#[derive(Debug, PartialEq)]
enum Kind {
    /// A statement ended by `;` (or a header before `{`).
    Text,
    /// A line directive without `;` (.version, .target, .address_size).
    Line,
    Open,
    Close,
    Label,
}

struct Stmt {
    line: usize,
    kind: Kind,
    text: String,
}

/// Splits PTX into statements, comments removed.
fn statements(ptx: &str) -> Vec<Stmt> {
    let mut out = Vec::new();
    let mut buf = String::new();
    let mut start = 0;
    let mut in_block_comment = false;
    let mut depth = 0usize;
    let mut inner = 0usize;
    for (i, raw) in ptx.lines().enumerate() {
        let line = i + 1;
        // Strip comments.
        let mut text = String::new();
        let mut rest = raw;
        loop {
            if in_block_comment {
                match rest.find("*/") {
                    Some(p) => {
                        rest = &rest[p + 2..];
                        in_block_comment = false;
                    }
                    None => break,
                }
            } else {
                let lc = rest.find("//");
                let bc = rest.find("/*");
                match (lc, bc) {
                    (Some(l), Some(b)) if b < l => {
                        text.push_str(&rest[..b]);
                        rest = &rest[b + 2..];
                        in_block_comment = true;
                    }
                    (None, Some(b)) => {
                        text.push_str(&rest[..b]);
                        rest = &rest[b + 2..];
                        in_block_comment = true;
                    }
                    (Some(l), _) => {
                        text.push_str(&rest[..l]);
                        break;
                    }
                    (None, None) => {
                        text.push_str(rest);
                        break;
                    }
                }
            }
        }
        let t = text.trim();
        if depth == 0
            && buf.trim().is_empty()
            && (t.starts_with(".version")
                || t.starts_with(".target")
                || t.starts_with(".address_size"))
        {
            out.push(Stmt {
                line,
                kind: Kind::Line,
                text: t.to_string(),
            });
            continue;
        }
        for ch in text.chars() {
            if buf.trim().is_empty() && !ch.is_whitespace() {
                start = line;
            }
            match ch {
                ';' => {
                    inner = 0;
                    out.push(Stmt {
                        line: start,
                        kind: Kind::Text,
                        text: squash(&buf),
                    });
                    buf.clear();
                }
                // Braces inside an instruction are a vector operand.
                '{' if !buf.trim().is_empty() && !buf.contains(".entry") => {
                    inner += 1;
                    buf.push(ch);
                }
                '}' if inner > 0 => {
                    inner -= 1;
                    buf.push(ch);
                }
                '{' | '}' => {
                    if !buf.trim().is_empty() {
                        out.push(Stmt {
                            line: start,
                            kind: Kind::Text,
                            text: squash(&buf),
                        });
                        buf.clear();
                    }
                    if ch == '{' {
                        depth += 1;
                        out.push(Stmt {
                            line,
                            kind: Kind::Open,
                            text: "{".into(),
                        });
                    } else {
                        depth = depth.saturating_sub(1);
                        out.push(Stmt {
                            line,
                            kind: Kind::Close,
                            text: "}".into(),
                        });
                    }
                }
                ':' if depth > 0 && is_ident(buf.trim()) => {
                    out.push(Stmt {
                        line: start,
                        kind: Kind::Label,
                        text: squash(&buf),
                    });
                    buf.clear();
                }
                _ => buf.push(ch),
            }
        }
        buf.push(' ');
    }
    if !buf.trim().is_empty() {
        out.push(Stmt {
            line: start,
            kind: Kind::Text,
            text: squash(&buf),
        });
    }
    out
}

/// A statement with its whitespace runs made single spaces.
fn squash(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$' || c == '.')
        && !s.starts_with('.')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// A type suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    B(u8),
    U(u8),
    S(u8),
    F(u8),
    Pred,
}

impl Ty {
    fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "b8" => Ty::B(8),
            "b16" => Ty::B(16),
            "b32" => Ty::B(32),
            "b64" => Ty::B(64),
            "u8" => Ty::U(8),
            "u16" => Ty::U(16),
            "u32" => Ty::U(32),
            "u64" => Ty::U(64),
            "s8" => Ty::S(8),
            "s16" => Ty::S(16),
            "s32" => Ty::S(32),
            "s64" => Ty::S(64),
            "f16" => Ty::F(16),
            "f32" => Ty::F(32),
            "f64" => Ty::F(64),
            "pred" => Ty::Pred,
            _ => return None,
        })
    }
    fn bits(self) -> u8 {
        match self {
            Ty::B(n) | Ty::U(n) | Ty::S(n) | Ty::F(n) => n,
            Ty::Pred => 1,
        }
    }
    fn signed(self) -> bool {
        matches!(self, Ty::S(_))
    }
    fn int(self) -> bool {
        matches!(self, Ty::B(_) | Ty::U(_) | Ty::S(_))
    }
    fn fw(self) -> Option<Fw> {
        match self {
            Ty::F(32) => Some(Fw::F32),
            Ty::F(64) => Some(Fw::F64),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Parser {
    /// Module-level static shared variables: (name, align, bytes).
    module_shared: Vec<(String, usize, usize)>,
    /// Module-level `.extern .shared` names (the dynamic part) and alignment.
    module_extern: Vec<(String, usize)>,
    kernels: Vec<Kernel>,
}

fn err(line: usize, stmt: &str, what: impl Into<String>) -> ParseError {
    ParseError {
        line,
        statement: stmt.to_string(),
        what: what.into(),
    }
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a.max(1)) * a.max(1)
}

/// Parses `.shared [.align A] .b8 name[N]` (or `name[]` for extern, or a
/// scalar `.shared .f32 name`): (name, align, bytes or None for `[]`).
fn shared_decl(words: &str) -> Option<(String, usize, Option<usize>)> {
    let mut align = 0usize;
    let mut elem = 0usize;
    let mut toks = words.split_whitespace().peekable();
    let mut name = None;
    while let Some(t) = toks.next() {
        match t {
            ".shared" | ".extern" => {}
            ".align" => align = toks.next()?.parse().ok()?,
            _ if t.starts_with('.') => elem = Ty::parse(&t[1..])?.bits() as usize / 8,
            _ => {
                name = Some(t.to_string());
                // The rest may be `name [N]` split by spaces.
                for r in toks.by_ref() {
                    name.as_mut().unwrap().push_str(r);
                }
            }
        }
    }
    let name = name?;
    if elem == 0 {
        return None;
    }
    let align = if align == 0 { elem } else { align };
    match name.find('[') {
        None => Some((name, align, Some(elem))),
        Some(p) => {
            let n = name[p + 1..].strip_suffix(']')?.trim();
            let ident = name[..p].to_string();
            if n.is_empty() {
                Some((ident, align, None))
            } else {
                Some((ident, align, Some(n.parse::<usize>().ok()? * elem)))
            }
        }
    }
}

impl Parser {
    fn module(mut self, ptx: &str) -> Result<Module, ParseError> {
        let stmts = statements(ptx);
        let mut i = 0;
        while i < stmts.len() {
            let s = &stmts[i];
            match s.kind {
                Kind::Line => {
                    let mut w = s.text.split_whitespace();
                    match w.next() {
                        Some(".address_size") => {
                            if w.next() != Some("64") {
                                return Err(err(
                                    s.line,
                                    &s.text,
                                    "only .address_size 64 is supported",
                                ));
                            }
                        }
                        Some(".version") | Some(".target") => {}
                        _ => return Err(err(s.line, &s.text, "unsupported directive")),
                    }
                    i += 1;
                }
                Kind::Text => {
                    let t = s.text.as_str();
                    let words: Vec<&str> = t.split_whitespace().collect();
                    if words.contains(&".entry") {
                        if stmts.get(i + 1).map(|n| &n.kind) != Some(&Kind::Open) {
                            return Err(err(
                                s.line,
                                t,
                                "an .entry without a body is not supported",
                            ));
                        }
                        i = self.function(&stmts, i)?;
                    } else if words.first() == Some(&".shared")
                        || (words.first() == Some(&".extern") && words.get(1) == Some(&".shared"))
                    {
                        let (name, align, bytes) = shared_decl(t).ok_or_else(|| {
                            err(s.line, t, "cannot parse this .shared declaration")
                        })?;
                        match bytes {
                            Some(b) if words[0] == ".shared" => {
                                self.module_shared.push((name, align, b))
                            }
                            None if words[0] == ".extern" => self.module_extern.push((name, align)),
                            _ => return Err(err(s.line, t, "unsupported .shared declaration")),
                        }
                        i += 1;
                    } else {
                        let what = words
                            .iter()
                            .find(|w| w.starts_with('.'))
                            .copied()
                            .unwrap_or(t);
                        return Err(err(
                            s.line,
                            t,
                            format!("unsupported module-level statement `{what}`"),
                        ));
                    }
                }
                _ => {
                    return Err(err(
                        s.line,
                        &s.text,
                        "unexpected brace or label at module level",
                    ));
                }
            }
        }
        Ok(Module {
            kernels: self.kernels,
        })
    }

    /// Parses the function whose header is stmts[i]; returns the index after its body.
    fn function(&mut self, stmts: &[Stmt], i: usize) -> Result<usize, ParseError> {
        let h = &stmts[i];
        let t = h.text.as_str();
        let open = t.find('(');
        let close = t.rfind(')');
        let (name, params_text, after) = match (open, close) {
            (Some(o), Some(c)) if c > o => (&t[..o], &t[o + 1..c], &t[c + 1..]),
            (None, None) => (t, "", ""),
            _ => return Err(err(h.line, t, "cannot parse the .entry header")),
        };
        let mut words = name.split_whitespace().collect::<Vec<_>>();
        let name = words.pop().unwrap_or("").to_string();
        for w in &words {
            if !matches!(*w, ".visible" | ".entry" | ".weak") {
                return Err(err(h.line, t, format!("unsupported entry attribute `{w}`")));
            }
        }
        // Parameters.
        let mut params = Vec::new();
        let mut offsets = Vec::new();
        let mut block = 0usize;
        for p in params_text
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let mut toks = p.split_whitespace().peekable();
            let mut align = 0usize;
            let mut elem = 0usize;
            let mut pname = String::new();
            while let Some(w) = toks.next() {
                match w {
                    ".param" | ".ptr" | ".global" | ".const" | ".shared" | ".local" => {}
                    ".align" => {
                        align = toks
                            .next()
                            .and_then(|a| a.parse().ok())
                            .ok_or_else(|| err(h.line, p, "bad .align"))?
                    }
                    _ if w.starts_with('.') => {
                        elem = Ty::parse(&w[1..])
                            .filter(|t| *t != Ty::Pred)
                            .ok_or_else(|| {
                                err(h.line, p, format!("unsupported parameter type `{w}`"))
                            })?
                            .bits() as usize
                            / 8
                    }
                    _ => pname.push_str(w),
                }
            }
            if elem == 0 || pname.is_empty() {
                return Err(err(h.line, p, "cannot parse this parameter"));
            }
            let (pn, bytes) = match pname.find('[') {
                Some(b) => {
                    let n: usize = pname[b + 1..]
                        .trim_end_matches(']')
                        .parse()
                        .map_err(|_| err(h.line, p, "bad parameter array size"))?;
                    (pname[..b].to_string(), n * elem)
                }
                None => (pname.clone(), elem),
            };
            let align = if align == 0 { elem } else { align };
            block = align_up(block, align);
            offsets.push(block);
            block += bytes;
            params.push(Param {
                name: pn,
                bytes,
                align,
            });
        }
        // Performance directives after the parameter list.
        let mut max_threads = None;
        let mut req_threads = None;
        let after = after.trim();
        if !after.is_empty() {
            let mut rest = after;
            while !rest.is_empty() {
                let (dir, tail) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                // Numbers until the next directive.
                let end = tail.find('.').unwrap_or(tail.len());
                let nums: Vec<u32> = tail[..end]
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<u32>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| err(h.line, after, format!("bad numbers after `{dir}`")))?;
                let mut dims = [1u32; 3];
                for (d, n) in dims.iter_mut().zip(&nums) {
                    *d = *n;
                }
                match dir {
                    ".maxntid" => max_threads = Some(dims.iter().product()),
                    ".reqntid" => req_threads = Some(dims),
                    ".minnctapersm" | ".maxnreg" | ".maxnctapersm" | ".noreturn" => {}
                    _ => {
                        return Err(err(
                            h.line,
                            after,
                            format!("unsupported entry directive `{dir}`"),
                        ));
                    }
                }
                rest = tail[end..].trim();
            }
        }

        let mut f = FnParser {
            scopes: vec![HashMap::new()],
            nregs: 0,
            consts: Vec::new(),
            const_map: HashMap::new(),
            sym_fix: Vec::new(),
            params: params
                .iter()
                .zip(&offsets)
                .map(|(p, o)| (p.name.clone(), (*o, p.bytes)))
                .collect(),
            labels: HashMap::new(),
            branch_fix: Vec::new(),
            insts: Vec::new(),
            src: Vec::new(),
            shared: Vec::new(),
        };
        // Module-level shared first.
        let mut shared_layout: HashMap<String, usize> = HashMap::new();
        let mut off = 0usize;
        for (n, a, b) in &self.module_shared {
            off = align_up(off, *a);
            shared_layout.insert(n.clone(), off);
            off += b;
        }
        let mut j = i + 2; // after header and `{`
        let mut depth = 1;
        let mut externs: Vec<(String, usize)> = self.module_extern.clone();
        while j < stmts.len() {
            let s = &stmts[j];
            j += 1;
            match s.kind {
                Kind::Open => {
                    depth += 1;
                    f.scopes.push(HashMap::new());
                }
                Kind::Close => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                    f.scopes.pop();
                }
                Kind::Label => {
                    if f.labels.insert(s.text.clone(), f.insts.len()).is_some() {
                        return Err(err(s.line, &s.text, "label defined twice"));
                    }
                }
                Kind::Line => {
                    return Err(err(
                        s.line,
                        &s.text,
                        "unexpected directive inside a function",
                    ));
                }
                Kind::Text => {
                    let t = s.text.as_str();
                    if t.is_empty() {
                        // A lone `;`.
                    } else if t.starts_with(".reg") {
                        f.declare(s.line, t)?;
                    } else if t.starts_with(".shared") || t.starts_with(".extern") {
                        let (name, align, bytes) = shared_decl(t).ok_or_else(|| {
                            err(s.line, t, "cannot parse this .shared declaration")
                        })?;
                        match bytes {
                            Some(b) if t.starts_with(".shared") => f.shared.push((name, align, b)),
                            None if t.starts_with(".extern") => externs.push((name, align)),
                            _ => return Err(err(s.line, t, "unsupported .shared declaration")),
                        }
                    } else if t.starts_with(".pragma") {
                        // e.g. "nounroll": a compiler hint.
                    } else if t.starts_with('.') {
                        let d = t.split_whitespace().next().unwrap_or(t);
                        return Err(err(s.line, t, format!("unsupported directive `{d}`")));
                    } else {
                        f.instruction(s.line, t).map_err(|w| err(s.line, t, w))?;
                    }
                }
            }
        }
        if depth != 0 {
            return Err(err(h.line, t, "function body not closed"));
        }
        for (n, a, b) in &f.shared {
            off = align_up(off, *a);
            shared_layout.insert(n.clone(), off);
            off += b;
        }
        let static_shared = off;
        let dyn_align = externs.iter().map(|e| e.1).max().unwrap_or(16).max(16);
        let dynamic_offset = align_up(static_shared, dyn_align);
        for (n, _) in &externs {
            shared_layout.insert(n.clone(), dynamic_offset);
        }
        // Fix up symbols, branches and placeholder register indices.
        // A kernel that falls off its end (or a label at its end) exits.
        let one = f.constant(1);
        f.insts.push(Inst {
            op: Op::Ret,
            g: one,
            gv: 1,
            d: 0,
            a: 0,
            b: 0,
            c: 0,
            imm: 0,
        });
        f.src.push((stmts[j - 1].line, "}".into()));
        for (ci, sym, line, text) in std::mem::take(&mut f.sym_fix) {
            let a = shared_layout
                .get(&sym)
                .ok_or_else(|| err(line, &text, format!("unknown symbol `{sym}`")))?;
            f.consts[ci] = *a as u64;
        }
        for (ii, label, line) in std::mem::take(&mut f.branch_fix) {
            let target = *f
                .labels
                .get(&label)
                .ok_or_else(|| err(line, &f.src[ii].1, format!("unknown label `{label}`")))?;
            f.insts[ii].imm = target as i64;
        }
        let nregs = f.nregs;
        let nconsts = f.consts.len() as u32;
        let fix = |r: &mut u32| {
            if *r >= CONST_BASE {
                *r = nregs + (*r - CONST_BASE);
            } else if *r >= SPEC_BASE {
                *r = nregs + nconsts + (*r - SPEC_BASE);
            }
        };
        for inst in &mut f.insts {
            fix(&mut inst.g);
            fix(&mut inst.d);
            fix(&mut inst.a);
            fix(&mut inst.b);
            fix(&mut inst.c);
            if let Op::Bfi(_) = inst.op {
                let mut len = inst.imm as u32;
                fix(&mut len);
                inst.imm = len as i64;
            }
        }
        if self.kernels.iter().any(|k| k.name == name) {
            return Err(err(h.line, t, format!("kernel `{name}` defined twice")));
        }
        self.kernels.push(Kernel {
            name,
            params,
            param_offsets: offsets,
            param_block: block,
            insts: f.insts,
            src: f.src,
            nregs,
            consts: f.consts,
            static_shared,
            dynamic_offset,
            max_threads,
            req_threads,
        });
        Ok(j)
    }
}

struct FnParser {
    scopes: Vec<HashMap<String, u32>>,
    nregs: u32,
    consts: Vec<u64>,
    const_map: HashMap<u64, u32>,
    /// (constant index, symbol, line, text) to resolve once shared memory is laid out.
    sym_fix: Vec<(usize, String, usize, String)>,
    params: HashMap<String, (usize, usize)>,
    labels: HashMap<String, usize>,
    branch_fix: Vec<(usize, String, usize)>,
    insts: Vec<Inst>,
    src: Vec<(usize, String)>,
    shared: Vec<(String, usize, usize)>,
}

fn parse_int(s: &str) -> Option<i64> {
    let s = s.strip_suffix('U').unwrap_or(s);
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()?
    } else if s.len() > 1 && s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit()) {
        u64::from_str_radix(&s[1..], 8).ok()?
    } else {
        s.parse::<u64>().ok()?
    };
    Some(if neg {
        (v as i64).wrapping_neg()
    } else {
        v as i64
    })
}

/// Splits operands at top-level commas (not inside `{}` or `[]`).
fn split_operands(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for ch in s.chars() {
        match ch {
            '{' | '[' => {
                depth += 1;
                cur.push(ch)
            }
            '}' | ']' => {
                depth -= 1;
                cur.push(ch)
            }
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
            }
            _ => cur.push(ch),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

impl FnParser {
    fn declare(&mut self, line: usize, t: &str) -> Result<(), ParseError> {
        // .reg .TYPE %name<N>, %other;
        let rest = t.trim_start_matches(".reg").trim();
        let (ty, names) = rest
            .split_once(char::is_whitespace)
            .ok_or_else(|| err(line, t, "bad .reg"))?;
        if !ty.starts_with('.') || Ty::parse(&ty[1..]).is_none() {
            return Err(err(line, t, format!("unsupported register type `{ty}`")));
        }
        for n in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if let Some(p) = n.find('<') {
                let count: u32 = n[p + 1..]
                    .trim_end_matches('>')
                    .parse()
                    .map_err(|_| err(line, t, "bad register count"))?;
                let base = &n[..p];
                for k in 0..count {
                    let idx = self.nregs;
                    self.nregs += 1;
                    self.scopes
                        .last_mut()
                        .unwrap()
                        .insert(format!("{base}{k}"), idx);
                }
            } else {
                let idx = self.nregs;
                self.nregs += 1;
                self.scopes.last_mut().unwrap().insert(n.to_string(), idx);
            }
        }
        if self.nregs >= SPEC_BASE {
            return Err(err(line, t, "too many registers"));
        }
        Ok(())
    }

    fn constant(&mut self, v: u64) -> u32 {
        if let Some(i) = self.const_map.get(&v) {
            return *i;
        }
        let i = CONST_BASE + self.consts.len() as u32;
        self.consts.push(v);
        self.const_map.insert(v, i);
        i
    }

    fn reg(&self, name: &str) -> Option<u32> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    /// A destination register.
    fn dst(&self, s: &str) -> Result<u32, String> {
        if s == "_" {
            return Err("sink `_` destinations are not supported".into());
        }
        self.reg(s).ok_or_else(|| format!("unknown register `{s}`"))
    }

    /// A source: register, special register, immediate (typed by `ty`) or symbol address.
    fn src(&mut self, s: &str, ty: Ty, line: usize, text: &str) -> Result<u32, String> {
        if let Some(r) = self.reg(s) {
            return Ok(r);
        }
        if let Some(sp) = s.strip_prefix('%') {
            let (base, comp) = sp
                .split_once('.')
                .ok_or_else(|| format!("unknown register `{s}`"))?;
            let c = match comp {
                "x" => 0,
                "y" => 1,
                "z" => 2,
                _ => return Err(format!("unsupported special register `{s}`")),
            };
            let b = match base {
                "tid" => 0,
                "ntid" => 3,
                "ctaid" => 6,
                "nctaid" => 9,
                _ => return Err(format!("unsupported special register `{s}`")),
            };
            return Ok(SPEC_BASE + b + c);
        }
        if let Some(h) = s.strip_prefix("0f").or_else(|| s.strip_prefix("0F")) {
            let bits =
                u32::from_str_radix(h, 16).map_err(|_| format!("bad f32 immediate `{s}`"))?;
            let v = match ty {
                Ty::F(64) => (f32::from_bits(bits) as f64).to_bits(),
                _ => bits as u64,
            };
            return Ok(self.constant(v));
        }
        if let Some(h) = s.strip_prefix("0d").or_else(|| s.strip_prefix("0D")) {
            let bits =
                u64::from_str_radix(h, 16).map_err(|_| format!("bad f64 immediate `{s}`"))?;
            let v = match ty {
                Ty::F(32) => (f64::from_bits(bits) as f32).to_bits() as u64,
                _ => bits,
            };
            return Ok(self.constant(v));
        }
        if let Some(v) = parse_int(s) {
            let bits = match ty {
                Ty::F(32) => (v as f32).to_bits() as u64,
                Ty::F(64) => (v as f64).to_bits(),
                _ => v as u64,
            };
            return Ok(self.constant(bits));
        }
        if (s.contains('.') || s.contains('e'))
            && let (Ok(f), Ty::F(_)) = (s.parse::<f64>(), ty)
        {
            let bits = if ty == Ty::F(32) {
                (f as f32).to_bits() as u64
            } else {
                f.to_bits()
            };
            return Ok(self.constant(bits));
        }
        if is_ident(s) {
            if self.params.contains_key(s) {
                return Err(format!("the address of parameter `{s}` is not supported"));
            }
            // A shared symbol's address, resolved at the end of the function.
            let i = self.consts.len();
            self.consts.push(0);
            self.sym_fix
                .push((i, s.to_string(), line, text.to_string()));
            return Ok(CONST_BASE + i as u32);
        }
        Err(format!("cannot parse operand `{s}`"))
    }

    /// `[base+off]`: (base register or placeholder, offset). A parameter
    /// base gives (u32::MAX, param offset + off, param bytes).
    fn address(
        &mut self,
        s: &str,
        line: usize,
        text: &str,
    ) -> Result<(u32, i64, Option<usize>), String> {
        let inner = s
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .ok_or_else(|| format!("expected an address, got `{s}`"))?
            .trim();
        let (base, off) = match inner.find('+') {
            Some(p) => {
                let o = parse_int(inner[p + 1..].trim())
                    .ok_or_else(|| format!("bad address offset in `{s}`"))?;
                (inner[..p].trim(), o)
            }
            None => match inner.rfind('-') {
                Some(p) if p > 0 => {
                    let o = parse_int(inner[p..].trim())
                        .ok_or_else(|| format!("bad address offset in `{s}`"))?;
                    (inner[..p].trim(), o)
                }
                _ => (inner, 0),
            },
        };
        if let Some((o, bytes)) = self.params.get(base).copied() {
            return Ok((
                u32::MAX,
                o as i64 + off,
                Some(bytes.saturating_sub(off.max(0) as usize)),
            ));
        }
        if let Some(v) = parse_int(base) {
            let c = self.constant(v as u64);
            return Ok((c, off, None));
        }
        Ok((self.src(base, Ty::U(64), line, text)?, off, None))
    }

    fn push(&mut self, line: usize, text: &str, inst: Inst) {
        self.insts.push(inst);
        self.src.push((line, text.to_string()));
    }

    fn instruction(&mut self, line: usize, text: &str) -> Result<(), String> {
        let mut t = text.trim();
        let (mut g, mut gv) = (u32::MAX, 1u64);
        if let Some(rest) = t.strip_prefix('@') {
            let (p, r) = rest
                .split_once(char::is_whitespace)
                .ok_or("guard without instruction")?;
            let (neg, p) = match p.strip_prefix('!') {
                Some(q) => (true, q),
                None => (false, p),
            };
            g = self
                .reg(p)
                .ok_or_else(|| format!("unknown guard predicate `{p}`"))?;
            gv = if neg { 0 } else { 1 };
            t = r.trim();
        }
        if g == u32::MAX {
            g = self.constant(1);
        }
        let (opcode, ops) = match t.split_once(char::is_whitespace) {
            Some((o, r)) => (o, r.trim()),
            None => (t, ""),
        };
        let ops = split_operands(ops);
        let mut parts = opcode.split('.');
        let base = parts.next().unwrap_or("");
        let mods: Vec<&str> = parts.collect();
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
        let flags: Vec<&str> = mods
            .iter()
            .filter(|m| Ty::parse(m).is_none())
            .copied()
            .collect();
        let mut inst = Inst {
            op: Op::Ret,
            g,
            gv,
            d: 0,
            a: 0,
            b: 0,
            c: 0,
            imm: 0,
        };
        let refuse = || format!("unsupported instruction `{opcode}`");
        let nops = |n: usize| -> Result<(), String> {
            if ops.len() == n {
                Ok(())
            } else {
                Err(format!(
                    "`{opcode}` expects {n} operands, got {}",
                    ops.len()
                ))
            }
        };
        let one_ty = || -> Result<Ty, String> {
            if types.len() == 1 {
                Ok(types[0])
            } else {
                Err(format!("unsupported instruction `{opcode}`"))
            }
        };
        // Only these flags, in any order.
        let only = |allowed: &[&str]| -> Result<(), String> {
            match flags.iter().find(|f| !allowed.contains(f)) {
                Some(f) => Err(format!("unsupported modifier `.{f}` in `{opcode}`")),
                None => Ok(()),
            }
        };
        match base {
            "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor"
            | "mad" | "fma" => {
                let ty = one_ty()?;
                let three = matches!(base, "mad" | "fma");
                nops(if three { 4 } else { 3 })?;
                if let Some(fw) = ty.fw() {
                    let rn = flags.contains(&"rn");
                    match base {
                        "add" | "sub" | "mul" | "fma" => {
                            only(&["rn"])?;
                            if base == "fma" && !rn {
                                return Err(refuse());
                            }
                        }
                        "div" => {
                            only(&["rn"])?;
                            if !rn {
                                return Err(format!(
                                    "unsupported instruction `{opcode}` (only div.rn)"
                                ));
                            }
                        }
                        "min" | "max" => only(&[])?,
                        _ => return Err(refuse()),
                    }
                    inst.op = match base {
                        "add" => Op::FAdd(fw),
                        "sub" => Op::FSub(fw),
                        "mul" => Op::FMul(fw),
                        "div" => Op::FDiv(fw),
                        "fma" => Op::Fma(fw),
                        "min" => Op::FMin(fw),
                        _ => Op::FMax(fw),
                    };
                } else if ty == Ty::Pred {
                    only(&[])?;
                    inst.op = match base {
                        "and" => Op::And(64),
                        "or" => Op::Or(64),
                        "xor" => Op::Xor(64),
                        _ => return Err(refuse()),
                    };
                } else if ty.int() && ty.bits() >= 16 {
                    let w = ty.bits();
                    let s = ty.signed();
                    inst.op = match (base, flags.as_slice()) {
                        ("add", []) => Op::Add(w),
                        ("sub", []) => Op::Sub(w),
                        ("mul", ["lo"]) => Op::MulLo(w),
                        ("mul", ["hi"]) => Op::MulHi(w, s),
                        ("mul", ["wide"]) if w <= 32 => Op::MulWide(w, s),
                        ("mad", ["lo"]) => Op::MadLo(w),
                        ("mad", ["wide"]) if w <= 32 => Op::MadWide(w, s),
                        ("div", []) => Op::Div(w, s),
                        ("rem", []) => Op::Rem(w, s),
                        ("min", []) => Op::Min(w, s),
                        ("max", []) => Op::Max(w, s),
                        ("and", []) => Op::And(w),
                        ("or", []) => Op::Or(w),
                        ("xor", []) => Op::Xor(w),
                        _ => return Err(refuse()),
                    };
                } else {
                    return Err(refuse());
                }
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], ty, line, text)?;
                inst.b = self.src(&ops[2], ty, line, text)?;
                if three {
                    // Wide mad's addend has the wide type.
                    let cty = match inst.op {
                        Op::MadWide(w, s) => {
                            if s {
                                Ty::S(w * 2)
                            } else {
                                Ty::U(w * 2)
                            }
                        }
                        _ => ty,
                    };
                    inst.c = self.src(&ops[3], cty, line, text)?;
                }
            }
            "neg" | "abs" | "not" | "sqrt" | "rcp" => {
                let ty = one_ty()?;
                nops(2)?;
                inst.op = match (base, ty.fw(), ty) {
                    ("neg", Some(fw), _) => {
                        only(&[])?;
                        Op::FNeg(fw)
                    }
                    ("abs", Some(fw), _) => {
                        only(&[])?;
                        Op::FAbs(fw)
                    }
                    ("sqrt", Some(fw), _) => {
                        only(&["rn"])?;
                        if !flags.contains(&"rn") {
                            return Err(refuse());
                        }
                        Op::Sqrt(fw)
                    }
                    ("rcp", Some(Fw::F64), _) if flags == ["approx", "ftz"] => Op::RcpApproxFtz64,
                    ("rcp", Some(fw), _) => {
                        if flags != ["rn"] {
                            return Err(refuse());
                        }
                        Op::Rcp(fw)
                    }
                    ("neg", None, Ty::S(w)) if w >= 16 && flags.is_empty() => Op::Neg(w),
                    ("abs", None, Ty::S(w)) if w >= 16 && flags.is_empty() => Op::Abs(w),
                    ("not", None, Ty::B(w)) if w >= 16 && flags.is_empty() => Op::Not(w),
                    ("not", None, Ty::Pred) if flags.is_empty() => Op::PNot,
                    _ => return Err(refuse()),
                };
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], ty, line, text)?;
            }
            "shl" | "shr" => {
                let ty = one_ty()?;
                nops(3)?;
                only(&[])?;
                inst.op = match (base, ty) {
                    ("shl", Ty::B(w)) if w >= 16 => Op::Shl(w),
                    ("shr", Ty::B(w) | Ty::U(w)) if w >= 16 => Op::Shr(w, false),
                    ("shr", Ty::S(w)) if w >= 16 => Op::Shr(w, true),
                    _ => return Err(refuse()),
                };
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], ty, line, text)?;
                inst.b = self.src(&ops[2], Ty::U(32), line, text)?;
            }
            "cvt" => {
                if types.len() != 2 {
                    return Err(refuse());
                }
                nops(2)?;
                let (to, from) = (types[0], types[1]);
                let rnd = match flags.as_slice() {
                    [] => None,
                    ["rn"] => Some(Rnd::Rn),
                    ["rni"] => Some(Rnd::Rni),
                    ["rzi"] => Some(Rnd::Rzi),
                    ["rmi"] => Some(Rnd::Rmi),
                    ["rpi"] => Some(Rnd::Rpi),
                    _ => return Err(format!("unsupported modifiers in `{opcode}`")),
                };
                let int = |t: Ty| t.int() && t.bits() >= 8;
                let fl = |t: Ty| matches!(t, Ty::F(_));
                let cvt = if int(to) && int(from) {
                    if rnd.is_some() {
                        return Err(refuse());
                    }
                    Cvt::II {
                        from: from.bits(),
                        signed: from.signed(),
                        to: to.bits(),
                    }
                } else if fl(to) && int(from) {
                    if rnd != Some(Rnd::Rn) {
                        return Err(format!(
                            "unsupported instruction `{opcode}` (int to float needs .rn)"
                        ));
                    }
                    Cvt::IF {
                        from: from.bits(),
                        signed: from.signed(),
                        to: to.bits(),
                    }
                } else if int(to) && fl(from) {
                    let r = match rnd {
                        Some(r @ (Rnd::Rni | Rnd::Rzi | Rnd::Rmi | Rnd::Rpi)) => r,
                        _ => {
                            return Err(format!(
                                "unsupported instruction `{opcode}` (float to int needs .rni/.rzi/.rmi/.rpi)"
                            ));
                        }
                    };
                    Cvt::FI {
                        from: from.bits(),
                        to: to.bits(),
                        signed: to.signed(),
                        rnd: r,
                    }
                } else if fl(to) && fl(from) {
                    let r = if to.bits() > from.bits() {
                        match rnd {
                            None => Rnd::Rn,
                            _ => return Err(refuse()),
                        }
                    } else if to.bits() < from.bits() {
                        match rnd {
                            Some(Rnd::Rn) => Rnd::Rn,
                            _ => return Err(refuse()),
                        }
                    } else {
                        match rnd {
                            Some(r @ (Rnd::Rni | Rnd::Rzi | Rnd::Rmi | Rnd::Rpi)) => r,
                            _ => return Err(refuse()),
                        }
                    };
                    Cvt::FF {
                        from: from.bits(),
                        to: to.bits(),
                        rnd: r,
                    }
                } else {
                    return Err(refuse());
                };
                inst.op = Op::Cvt(cvt);
                inst.d = self.dst(&ops[0])?;
                let src_ty = if from == Ty::F(16) { Ty::B(16) } else { from };
                inst.a = self.src(&ops[1], src_ty, line, text)?;
            }
            "setp" => {
                let ty = one_ty()?;
                nops(3)?;
                if flags.len() != 1 || ops[0].contains('|') {
                    return Err(format!("unsupported form of `{opcode}`"));
                }
                let cmp = match flags[0] {
                    "eq" => Cmp::Eq,
                    "ne" => Cmp::Ne,
                    "lt" => Cmp::Lt,
                    "le" => Cmp::Le,
                    "gt" => Cmp::Gt,
                    "ge" => Cmp::Ge,
                    "lo" if ty.int() => Cmp::Lt,
                    "ls" if ty.int() => Cmp::Le,
                    "hi" if ty.int() => Cmp::Gt,
                    "hs" if ty.int() => Cmp::Ge,
                    "equ" => Cmp::Equ,
                    "neu" => Cmp::Neu,
                    "ltu" => Cmp::Ltu,
                    "leu" => Cmp::Leu,
                    "gtu" => Cmp::Gtu,
                    "geu" => Cmp::Geu,
                    "num" => Cmp::Num,
                    "nan" => Cmp::Nan,
                    _ => return Err(refuse()),
                };
                let signed_cmp = matches!(flags[0], "lt" | "le" | "gt" | "ge") && ty.signed();
                inst.op = match ty {
                    _ if ty.fw().is_some() => Op::SetpF(cmp, ty.fw().unwrap()),
                    _ if ty.int()
                        && ty.bits() >= 16
                        && matches!(
                            cmp,
                            Cmp::Eq | Cmp::Ne | Cmp::Lt | Cmp::Le | Cmp::Gt | Cmp::Ge
                        ) =>
                    {
                        if matches!(ty, Ty::B(_)) && !matches!(cmp, Cmp::Eq | Cmp::Ne) {
                            return Err(refuse());
                        }
                        Op::SetpI(cmp, ty.bits(), signed_cmp)
                    }
                    _ => return Err(refuse()),
                };
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], ty, line, text)?;
                inst.b = self.src(&ops[2], ty, line, text)?;
            }
            "selp" => {
                let ty = one_ty()?;
                nops(4)?;
                only(&[])?;
                if ty == Ty::Pred || ty.bits() < 16 {
                    return Err(refuse());
                }
                inst.op = Op::Selp;
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], ty, line, text)?;
                inst.b = self.src(&ops[2], ty, line, text)?;
                inst.c = self
                    .reg(&ops[3])
                    .ok_or_else(|| format!("unknown predicate `{}`", ops[3]))?;
            }
            "mov" => {
                let ty = one_ty()?;
                nops(2)?;
                only(&[])?;
                if ty.bits() < 16 && ty != Ty::Pred {
                    return Err(refuse());
                }
                let lhs = &ops[0];
                let rhs = &ops[1];
                let vec = |s: &str| -> Option<Vec<String>> {
                    s.strip_prefix('{')?
                        .strip_suffix('}')
                        .map(|r| r.split(',').map(|x| x.trim().to_string()).collect())
                };
                if let Some(parts) = vec(rhs) {
                    if parts.len() != 2 || !matches!(ty, Ty::B(32) | Ty::B(64)) {
                        return Err(format!("unsupported vector form of `{opcode}`"));
                    }
                    let h = Ty::B(ty.bits() / 2);
                    inst.op = Op::Pack(ty.bits() / 2);
                    inst.d = self.dst(lhs)?;
                    inst.a = self.src(&parts[0], h, line, text)?;
                    inst.b = self.src(&parts[1], h, line, text)?;
                } else if let Some(parts) = vec(lhs) {
                    if parts.len() != 2 || !matches!(ty, Ty::B(32) | Ty::B(64)) {
                        return Err(format!("unsupported vector form of `{opcode}`"));
                    }
                    inst.op = Op::Unpack(ty.bits() / 2);
                    inst.d = self.dst(&parts[0])?;
                    inst.a = self.dst(&parts[1])?;
                    inst.b = self.src(rhs, ty, line, text)?;
                } else {
                    inst.op = Op::Mov;
                    inst.d = self.dst(lhs)?;
                    inst.a = self.src(rhs, ty, line, text)?;
                }
            }
            "bfi" => {
                let w = match types.as_slice() {
                    [Ty::B(w @ (32 | 64))] if flags.is_empty() => *w,
                    _ => return Err(refuse()),
                };
                nops(5)?;
                inst.op = Op::Bfi(w);
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], Ty::B(w), line, text)?;
                inst.b = self.src(&ops[2], Ty::B(w), line, text)?;
                inst.c = self.src(&ops[3], Ty::U(32), line, text)?;
                inst.imm = self.src(&ops[4], Ty::U(32), line, text)? as i64;
            }
            "bfe" => {
                let (w, signed) = match types.as_slice() {
                    [Ty::U(w @ (32 | 64))] if flags.is_empty() => (*w, false),
                    [Ty::S(w @ (32 | 64))] if flags.is_empty() => (*w, true),
                    _ => return Err(refuse()),
                };
                nops(4)?;
                inst.op = Op::Bfe(w, signed);
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], Ty::B(w), line, text)?;
                inst.b = self.src(&ops[2], Ty::U(32), line, text)?;
                inst.c = self.src(&ops[3], Ty::U(32), line, text)?;
            }
            "prmt" => {
                if types != [Ty::B(32)] || !flags.is_empty() {
                    return Err(refuse());
                }
                nops(4)?;
                inst.op = Op::Prmt;
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], Ty::B(32), line, text)?;
                inst.b = self.src(&ops[2], Ty::B(32), line, text)?;
                inst.c = self.src(&ops[3], Ty::B(32), line, text)?;
            }
            "ld" | "st" => {
                let ty = one_ty()?;
                nops(2)?;
                if ty == Ty::Pred {
                    return Err(refuse());
                }
                let size = ty.bits() / 8;
                let mut space = None;
                for f in &flags {
                    match *f {
                        "global" | "shared" | "param" if space.is_none() => space = Some(*f),
                        // Cache hints change nothing here.
                        "nc" | "ca" | "cg" | "cs" | "lu" | "cv" | "wb" | "wt"
                            if base == "ld" || !matches!(*f, "nc") => {}
                        _ => return Err(format!("unsupported modifier `.{f}` in `{opcode}`")),
                    }
                }
                let space = space.ok_or_else(|| {
                    format!("unsupported instruction `{opcode}` (generic addressing)")
                })?;
                let (val, addr) = if base == "ld" {
                    (&ops[0], &ops[1])
                } else {
                    (&ops[1], &ops[0])
                };
                let (a, off, pbytes) = self.address(addr, line, text)?;
                match (base, space) {
                    ("ld", "param") => {
                        let avail =
                            pbytes.ok_or("ld.param needs a parameter name as its address")?;
                        if off < 0 || (size as usize) > avail {
                            return Err(format!(
                                "ld.param of {size} bytes past the end of its parameter"
                            ));
                        }
                        inst.op = Op::LdParam(size, ty.signed());
                        inst.imm = off;
                        inst.d = self.dst(val)?;
                    }
                    (_, "param") => return Err(refuse()),
                    (_, sp) => {
                        if pbytes.is_some() {
                            return Err("a parameter name as a global or shared address".into());
                        }
                        let space = if sp == "global" {
                            Space::Global
                        } else {
                            Space::Shared
                        };
                        inst.a = a;
                        inst.imm = off;
                        if base == "ld" {
                            inst.op = Op::Ld(space, size, ty.signed());
                            inst.d = self.dst(val)?;
                        } else {
                            inst.op = Op::St(space, size);
                            inst.b = self.src(val, ty, line, text)?;
                        }
                    }
                }
            }
            "cvta" => {
                // cvta.to.global.u64: global addresses are the same in both windows.
                if flags != ["to", "global"] || types != [Ty::U(64)] {
                    return Err(refuse());
                }
                nops(2)?;
                inst.op = Op::Mov;
                inst.d = self.dst(&ops[0])?;
                inst.a = self.src(&ops[1], Ty::U(64), line, text)?;
            }
            "bar" | "barrier" => {
                let ok = match base {
                    "bar" => flags == ["sync"],
                    _ => flags == ["sync"] || flags == ["sync", "aligned"],
                };
                if !ok || !types.is_empty() {
                    return Err(refuse());
                }
                if ops.len() != 1 || parse_int(&ops[0]) != Some(0) {
                    return Err(format!(
                        "only `{opcode} 0` (the whole block, barrier 0) is supported"
                    ));
                }
                inst.op = Op::Bar;
            }
            "bra" => {
                if !(flags.is_empty() || flags == ["uni"]) || !types.is_empty() {
                    return Err(refuse());
                }
                nops(1)?;
                inst.op = Op::Bra;
                self.branch_fix
                    .push((self.insts.len(), ops[0].clone(), line));
            }
            "ret" | "exit" => {
                if !mods.is_empty() || !ops.is_empty() {
                    return Err(refuse());
                }
                inst.op = Op::Ret;
            }
            _ => return Err(refuse()),
        }
        self.push(line, text, inst);
        Ok(())
    }
}
