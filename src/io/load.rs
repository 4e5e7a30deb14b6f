//! Loading a torchvision-layout state_dict into a model.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::io::{ModelMeta, RawData, RawTensor, TensorFile, guess_architecture, stem_flag};
use crate::nn::{ResNet, StateSlot, StemKind};

/// How many problems one error lists before summarising the rest.
const MAX_LISTED: usize = 20;

const HEAD: [&str; 2] = ["fc.weight", "fc.bias"];

/// Number of classes of the file's head (rows of `fc.weight`, else the
/// length of `fc.bias`), for defaulting `--num-classes` when fine-tuning.
pub fn fc_rows(file: &TensorFile) -> Option<usize> {
    if let Some(t) = file.tensors.get("fc.weight")
        && t.shape.len() == 2
    {
        return Some(t.shape[0]);
    }
    match file.tensors.get("fc.bias") {
        Some(t) if t.shape.len() == 1 => Some(t.shape[0]),
        _ => None,
    }
}

/// Loads a torchvision-layout state_dict into `model` (one in memfit's own
/// training files, hence `ignore_prefixes`). Names, shapes and
/// dtypes are checked; every missing, unexpected or mis-shaped entry is
/// listed in one error. Keys starting with one of `ignore_prefixes` are
/// skipped (a file may carry other tensors). `num_batches_tracked` may be
/// shape `[]` (as torch saves it) or `[1]`. Nothing is written into the model
/// unless the whole file matches.
pub fn load_state_dict(
    model: &mut ResNet,
    file: &TensorFile,
    ignore_prefixes: &[&str],
) -> Result<()> {
    load(model, file, ignore_prefixes, &[])
}

/// Loads a torchvision ResNet state_dict strictly (every entry of the model
/// present with its shape and dtype, nothing else in the file). With
/// `reset_head`, `fc.weight` and `fc.bias` of the file are skipped and the
/// model keeps its freshly initialised head, whatever its number of classes:
/// fine-tuning a pretrained backbone on a new label set.
///
/// A memfit training state file is a weights file too: its optimizer
/// buffers (`optimizer.*`) are not state_dict entries and are ignored.
pub fn load_torchvision(model: &mut ResNet, file: &TensorFile, reset_head: bool) -> Result<()> {
    let skip: &[&str] = if reset_head { &HEAD } else { &[] };
    let ignore: &[&str] = if file.metadata.contains_key(STATE_FILE_KEY) {
        &[STATE_EXTRAS_PREFIX]
    } else {
        &[]
    };
    load(model, file, ignore, skip)
}

/// The metadata key that marks a memfit training state file (its value is
/// the format version), and the prefix of its non-state_dict tensors.
pub const STATE_FILE_KEY: &str = "memfit_checkpoint";
pub const STATE_EXTRAS_PREFIX: &str = "optimizer.";

fn bad(file: &TensorFile, reason: String) -> Error {
    Error::BadWeights {
        path: file.path.clone(),
        reason,
    }
}

/// Rejects files that are not ResNet state_dicts at all, before listing
/// hundreds of "missing" entries.
fn check_looks_like_resnet(file: &TensorFile) -> Result<()> {
    if file.tensors.contains_key("conv1.weight") {
        return Ok(());
    }
    let mut reason = String::from("does not look like a torchvision ResNet state_dict");
    if file.tensors.contains_key("module.conv1.weight") {
        reason.push_str(
            ": its names start with 'module.' (saved from nn.DataParallel / DDP); \
             save `model.module.state_dict()` instead",
        );
    } else if file.tensors.is_empty() {
        reason.push_str(": it holds no tensors");
    } else {
        let some: Vec<&str> = file.tensors.keys().take(5).map(String::as_str).collect();
        reason.push_str(&format!(
            " (no 'conv1.weight'); it holds {} tensors, e.g. {}",
            file.tensors.len(),
            some.iter()
                .map(|s| format!("'{s}'"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Err(bad(file, reason))
}

/// The problem with tensor `t` as the value of `slot`, if any.
fn check_slot(slot: &StateSlot<'_>, name: &str, t: &RawTensor) -> Option<String> {
    match (slot, &t.data) {
        (StateSlot::Param { torch_shape, .. }, RawData::F32(_)) => (t.shape != *torch_shape)
            .then(|| format!("'{name}' has shape {:?}, expected {torch_shape:?}", t.shape)),
        (StateSlot::Buffer { tensor, .. }, RawData::F32(_)) => {
            (t.shape != [tensor.numel()]).then(|| {
                format!(
                    "'{name}' has shape {:?}, expected [{}]",
                    t.shape,
                    tensor.numel()
                )
            })
        }
        // torch saves a 0-d tensor; accept [] and [1].
        (StateSlot::Count { .. }, RawData::I64(_)) => (!(t.shape.is_empty() || t.shape == [1]))
            .then(|| format!("'{name}' has shape {:?}, expected [] (or [1])", t.shape)),
        (StateSlot::Count { .. }, RawData::F32(_)) => {
            Some(format!("'{name}' is F32, expected I64"))
        }
        (_, RawData::I64(_)) => Some(format!("'{name}' is I64, expected F32")),
    }
}

/// Copies a checked tensor into the model, through the backend (a model on
/// a GPU loads as one on the CPU).
fn copy_into(slot: StateSlot<'_>, t: &RawTensor) -> Result<()> {
    match (slot, &t.data) {
        (
            StateSlot::Param {
                param,
                torch_shape,
                layout,
            },
            RawData::F32(v),
        ) => crate::backend::copy_from_host(&mut param.value, &layout.from_torch(v, &torch_shape)),
        (StateSlot::Buffer { tensor, .. }, RawData::F32(v)) => {
            crate::backend::copy_from_host(tensor, v)
        }
        (StateSlot::Count { value, .. }, RawData::I64(v)) => {
            *value = v[0];
            Ok(())
        }
        _ => unreachable!("checked by check_slot"),
    }
}

/// A hint for the most common whole-file mismatches.
fn hints(model: &mut ResNet, file: &TensorFile, fc_mismatch: bool) -> Vec<String> {
    let mut out = Vec::new();
    // What the file says (or looks like) it is, when the model is another
    // architecture: the flags to pass.
    let c = &model.config;
    if let Some(m) = ModelMeta::of_file(file).or_else(|| guess_architecture(file))
        && let Ok(zoo) = crate::nn::ResNetConfig::by_name(&m.model)
        && (zoo.block != c.block
            || zoo.layers != c.layers
            || m.base_width != c.base_width
            || m.stem != c.stem)
    {
        let said = if ModelMeta::of_file(file).is_some() {
            "this file holds"
        } else {
            "this looks like"
        };
        out.push(format!(
            "{said} a {} at base width {} with the {} stem and {} classes; pass --model {} --base-width {} --stem {}",
            m.model,
            m.base_width,
            stem_flag(m.stem),
            m.num_classes,
            m.model,
            m.base_width,
            stem_flag(m.stem)
        ));
    }
    let classes = model.config.num_classes;
    if fc_mismatch
        && let Some(rows) = fc_rows(file)
        && rows != classes
    {
        out.push(format!(
            "the file's head has {rows} classes and the model's {classes}: pass --reset-head \
             to keep a fresh {classes}-class head (fine-tuning), or --num-classes {rows}"
        ));
    }
    let file_bottleneck = file.tensors.contains_key("layer1.0.conv3.weight");
    let model_bottleneck = matches!(model.config.block, crate::nn::BlockKind::Bottleneck);
    if file.tensors.contains_key("layer1.0.conv1.weight") && file_bottleneck != model_bottleneck {
        let kind = |b: bool| if b { "Bottleneck" } else { "BasicBlock" };
        out.push(format!(
            "the file has {} blocks and the model {} blocks: is it another ResNet depth?",
            kind(file_bottleneck),
            kind(model_bottleneck)
        ));
    }
    // conv1 is 7×7 in torchvision's ImageNet stem and 3×3 in the small one.
    let stem_of_file = file
        .tensors
        .get("conv1.weight")
        .and_then(|t| match t.shape[..] {
            [_, _, 7, 7] => Some(StemKind::ImageNet),
            [_, _, 3, 3] => Some(StemKind::Small),
            _ => None,
        });
    if let Some(stem) = stem_of_file
        && stem != model.config.stem
    {
        let flag = |s: StemKind| match s {
            StemKind::ImageNet => "imagenet",
            StemKind::Small => "small",
        };
        out.push(format!(
            "the file has the {} stem and the model the {} stem: pass --stem {}",
            flag(stem),
            flag(model.config.stem),
            flag(stem)
        ));
    }
    out
}

fn load(
    model: &mut ResNet,
    file: &TensorFile,
    ignore_prefixes: &[&str],
    skip: &[&str],
) -> Result<()> {
    check_looks_like_resnet(file)?;
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    let mut fc_mismatch = false;
    // First pass: check everything, write nothing.
    model.visit_state(|slot| {
        let name = slot.name().to_string();
        seen.insert(name.clone());
        if skip.contains(&name.as_str()) {
            return;
        }
        match file.tensors.get(&name) {
            None => problems.push(format!("missing '{name}'")),
            Some(t) => {
                if let Some(p) = check_slot(&slot, &name, t) {
                    fc_mismatch |= HEAD.contains(&name.as_str());
                    problems.push(p);
                }
            }
        }
    });
    for name in file.tensors.keys() {
        let ignored =
            ignore_prefixes.iter().any(|p| name.starts_with(p)) || skip.contains(&name.as_str());
        if !seen.contains(name) && !ignored {
            problems.push(format!("unexpected '{name}'"));
        }
    }
    if !problems.is_empty() {
        let n = problems.len();
        let mut listed: Vec<String> = problems.into_iter().take(MAX_LISTED).collect();
        if n > MAX_LISTED {
            listed.push(format!("... and {} more", n - MAX_LISTED));
        }
        // Hints first: with a long list they would scroll away.
        let mut lines = hints(model, file, fc_mismatch);
        lines.extend(listed);
        return Err(bad(
            file,
            format!(
                "does not match the model ({n} problem{}):\n  {}",
                if n == 1 { "" } else { "s" },
                lines.join("\n  ")
            ),
        ));
    }
    // Second pass: everything matches, copy.
    let mut res = Ok(());
    model.visit_state(|slot| {
        let name = slot.name();
        if skip.contains(&name) || res.is_err() {
            return;
        }
        let t = &file.tensors[name];
        res = copy_into(slot, t);
    });
    res
}
