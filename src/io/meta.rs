//! What a weights file says it is: the model, base width, stem, classes
//! and class names memfit writes into a safetensors file's `__metadata__`
//! (on `--save-weights` and in every training state file), and, for files
//! without them (torchvision's, older memfit's), a guess from the tensors'
//! names and shapes for error hints.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::io::TensorFile;
use crate::nn::StemKind;

/// Metadata keys (prefixed, so they cannot clash with other tools').
pub const MODEL_KEY: &str = "memfit_model";
pub const BASE_WIDTH_KEY: &str = "memfit_base_width";
pub const STEM_KEY: &str = "memfit_stem";
pub const NUM_CLASSES_KEY: &str = "memfit_num_classes";
pub const CLASS_NAMES_KEY: &str = "memfit_class_names";
/// The input the model was trained on: its side, and for image folders the
/// evaluation transform (shorter side before the centre crop, per-channel
/// mean and std), so `eval` feeds it what it was trained on.
pub const IMAGE_SIZE_KEY: &str = "memfit_image_size";
pub const EVAL_RESIZE_KEY: &str = "memfit_eval_resize";
pub const MEAN_KEY: &str = "memfit_normalize_mean";
pub const STD_KEY: &str = "memfit_normalize_std";

/// The architecture of a weights file and the names of its classes.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelMeta {
    /// resnet18, resnet34, resnet50, resnet101 or resnet152.
    pub model: String,
    pub base_width: usize,
    pub stem: StemKind,
    pub num_classes: usize,
    /// The class of each output, in order (an image folder's class
    /// folders); None for the built-in sets, whose classes are numbers.
    pub class_names: Option<Vec<String>>,
    /// The input it was trained on (None in files without it).
    pub input: Option<InputMeta>,
}

/// The network input a model was trained on.
#[derive(Clone, Debug, PartialEq)]
pub struct InputMeta {
    /// Side of the square input.
    pub image_size: usize,
    /// Image folders' evaluation transform (None for the built-in sets,
    /// which are stored normalised): the shorter side images are resized
    /// to before the centre crop, and the per-channel mean and std.
    pub folder: Option<FolderInput>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FolderInput {
    pub eval_resize: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

fn floats3(s: &str) -> Option<[f32; 3]> {
    let v: Vec<f32> = serde_json::from_str(s).ok()?;
    v.try_into().ok()
}

impl InputMeta {
    fn insert_into(&self, m: &mut HashMap<String, String>) {
        m.insert(IMAGE_SIZE_KEY.into(), self.image_size.to_string());
        if let Some(f) = &self.folder {
            m.insert(EVAL_RESIZE_KEY.into(), f.eval_resize.to_string());
            // Rust's shortest round-trip form: "[0.485,0.456,0.406]".
            let list = |v: [f32; 3]| format!("[{},{},{}]", v[0], v[1], v[2]);
            m.insert(MEAN_KEY.into(), list(f.mean));
            m.insert(STD_KEY.into(), list(f.std));
        }
    }

    fn of_metadata(m: &BTreeMap<String, String>) -> Option<InputMeta> {
        let image_size = m.get(IMAGE_SIZE_KEY)?.parse().ok()?;
        let folder = (|| {
            Some(FolderInput {
                eval_resize: m.get(EVAL_RESIZE_KEY)?.parse().ok()?,
                mean: floats3(m.get(MEAN_KEY)?)?,
                std: floats3(m.get(STD_KEY)?)?,
            })
        })();
        Some(InputMeta { image_size, folder })
    }
}

/// `imagenet` or `small`, as the `--stem` flag spells them.
pub fn stem_flag(s: StemKind) -> &'static str {
    match s {
        StemKind::ImageNet => "imagenet",
        StemKind::Small => "small",
    }
}

fn parse_stem(s: &str) -> Option<StemKind> {
    match s {
        "imagenet" => Some(StemKind::ImageNet),
        "small" => Some(StemKind::Small),
        _ => None,
    }
}

impl ModelMeta {
    /// The `__metadata__` entries.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        let mut m = HashMap::from([
            (MODEL_KEY.to_string(), self.model.clone()),
            (BASE_WIDTH_KEY.to_string(), self.base_width.to_string()),
            (STEM_KEY.to_string(), stem_flag(self.stem).to_string()),
            (NUM_CLASSES_KEY.to_string(), self.num_classes.to_string()),
        ]);
        if let Some(names) = &self.class_names {
            m.insert(
                CLASS_NAMES_KEY.to_string(),
                serde_json::Value::from(names.clone()).to_string(),
            );
        }
        if let Some(input) = &self.input {
            input.insert_into(&mut m);
        }
        m
    }

    /// The input `file` says its model was trained on, if it says.
    pub fn input_of_file(file: &TensorFile) -> Option<InputMeta> {
        InputMeta::of_metadata(&file.metadata)
    }

    /// The metadata of `file`, if it carries memfit's (all four of model,
    /// base width, stem and classes, readable).
    pub fn of_file(file: &TensorFile) -> Option<ModelMeta> {
        let m = &file.metadata;
        let class_names = m.get(CLASS_NAMES_KEY).and_then(|s| {
            let v: serde_json::Value = serde_json::from_str(s).ok()?;
            v.as_array()?
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
        });
        Some(ModelMeta {
            model: m.get(MODEL_KEY)?.clone(),
            base_width: m.get(BASE_WIDTH_KEY)?.parse().ok()?,
            stem: parse_stem(m.get(STEM_KEY)?)?,
            num_classes: m.get(NUM_CLASSES_KEY)?.parse().ok()?,
            class_names,
            input: InputMeta::of_metadata(m),
        })
    }
}

/// The zoo's blocks per layer and whether they are bottlenecks.
const ZOO: [(&str, bool, [usize; 4]); 5] = [
    ("resnet18", false, [2, 2, 2, 2]),
    ("resnet34", false, [3, 4, 6, 3]),
    ("resnet50", true, [3, 4, 6, 3]),
    ("resnet101", true, [3, 4, 23, 3]),
    ("resnet152", true, [3, 8, 36, 3]),
];

/// The zoo model whose tensors `file` holds, guessed from its names and
/// shapes (no metadata needed): blocks per layer, block kind, `conv1`'s
/// output channels (the base width) and kernel (the stem), `fc`'s rows.
/// None when it matches no zoo model.
pub fn guess_architecture(file: &TensorFile) -> Option<ModelMeta> {
    let conv1 = file.tensors.get("conv1.weight")?;
    let (base_width, stem) = match conv1.shape[..] {
        [o, _, 7, 7] => (o, StemKind::ImageNet),
        [o, _, 3, 3] => (o, StemKind::Small),
        _ => return None,
    };
    let mut blocks = [
        BTreeSet::new(),
        BTreeSet::new(),
        BTreeSet::new(),
        BTreeSet::new(),
    ];
    for name in file.tensors.keys() {
        let mut parts = name.split('.');
        if let (Some(layer), Some(block)) = (parts.next(), parts.next())
            && let Some(l) = layer
                .strip_prefix("layer")
                .and_then(|l| l.parse::<usize>().ok())
            && (1..=4).contains(&l)
            && let Ok(b) = block.parse::<usize>()
        {
            blocks[l - 1].insert(b);
        }
    }
    let layers = blocks.map(|b| b.len());
    let bottleneck = file.tensors.contains_key("layer1.0.conv3.weight");
    let model = ZOO
        .iter()
        .find(|(_, b, l)| *b == bottleneck && *l == layers)?
        .0;
    let num_classes = crate::io::fc_rows(file)?;
    Some(ModelMeta {
        model: model.to_string(),
        base_width,
        stem,
        num_classes,
        class_names: None,
        input: None,
    })
}
