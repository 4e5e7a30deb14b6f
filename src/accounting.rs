//! The vocabulary of byte accounting, shared by the pool that counts
//! bytes, the tensors that hold them and the error a refused allocation
//! returns: what a buffer is for ([`Category`]), its name ([`Tag`]), bytes
//! per category, and the report of an allocation over budget. It sits at
//! the bottom of the crate and imports nothing from it, so `error`,
//! `tensor` and `memory` no longer import each other in a circle.

use std::fmt;
use std::sync::Arc;

/// What a buffer is for. The planner and the reports speak in these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    Params,
    Grads,
    Optimizer,
    Activations,
    Workspace,
    Data,
}

impl Category {
    pub const ALL: [Category; 6] = [
        Category::Params,
        Category::Grads,
        Category::Optimizer,
        Category::Activations,
        Category::Workspace,
        Category::Data,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::Data => "data",
        }
    }
}

/// A buffer's name: a shared prefix (usually a torchvision module path such
/// as `layer3.2.conv1`) and a static field (`y`, `col`, ...). Cloning is
/// cheap, so tagging an allocation never allocates.
#[derive(Clone, Debug)]
pub struct Tag {
    prefix: Option<Arc<str>>,
    field: &'static str,
}

impl Tag {
    pub fn new(prefix: &Arc<str>, field: &'static str) -> Self {
        Tag {
            prefix: Some(prefix.clone()),
            field,
        }
    }

    pub fn fixed(field: &'static str) -> Self {
        Tag {
            prefix: None,
            field,
        }
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.prefix {
            Some(p) if self.field.is_empty() => write!(f, "{p}"),
            Some(p) => write!(f, "{p}.{}", self.field),
            None => write!(f, "{}", self.field),
        }
    }
}

/// Bytes per category, indexable by [`Category`].
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ByCategory(pub(crate) [usize; 6]);

impl ByCategory {
    pub fn get(&self, c: Category) -> usize {
        self.0[c.index()]
    }
    pub fn total(&self) -> usize {
        self.0.iter().sum()
    }
}

impl fmt::Display for ByCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = Category::ALL
            .iter()
            .map(|c| format!("{} {}", c.name(), fmt_bytes(self.get(*c))))
            .collect();
        write!(f, "{}", parts.join(", "))
    }
}

/// `1536` -> `"1.50 KiB"`.
pub fn fmt_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Why an allocation was refused.
#[derive(Debug, Clone)]
pub struct BudgetReport {
    pub tag: String,
    pub category: Category,
    pub requested: usize,
    pub budget: usize,
    pub live: ByCategory,
    /// The largest live buffers, largest first: (tag, category, bytes).
    pub largest: Vec<(String, Category, usize)>,
}

impl fmt::Display for BudgetReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "out of memory budget: {} ({}) needs {} but {} of the {} budget are live",
            self.tag,
            self.category.name(),
            fmt_bytes(self.requested),
            fmt_bytes(self.live.total()),
            fmt_bytes(self.budget),
        )?;
        writeln!(f, "  live by category: {}", self.live)?;
        write!(f, "  largest live buffers:")?;
        for (tag, cat, bytes) in &self.largest {
            write!(
                f,
                "\n    {:>12}  {:<11} {tag}",
                fmt_bytes(*bytes),
                cat.name()
            )?;
        }
        Ok(())
    }
}
