//! ResNet-18/34/50/101/152 as a chain of stages, with torchvision's names,
//! layout and initialisation.

use rand::{SeedableRng, rngs::ChaCha8Rng};

use crate::device::Target;
use crate::error::{Error, Result};
use crate::memory::Pool;
use crate::nn::{
    BasicBlock, BasicSaved, BatchNorm, BnPolicy, Bottleneck, BottleneckSaved, Conv, Ctx, Head,
    HeadSaved, Linear, Mode, Param, Precision, Stem, StemKind, StemSaved,
};
use crate::tensor::Tensor;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Basic,
    Bottleneck,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    pub block: BlockKind,
    /// Blocks per layer (layer1..layer4).
    pub layers: [usize; 4],
    /// Channels of the stem and of layer1's `planes` (64 in torchvision).
    pub base_width: usize,
    pub num_classes: usize,
    /// The stem: torchvision's ImageNet stem, or the small-image one for
    /// 28×28 / 32×32 inputs.
    pub stem: StemKind,
    /// Start the last BN of every block at weight 0 (each block begins as
    /// the identity), torchvision's `zero_init_residual`.
    pub zero_init_residual: bool,
    pub seed: u64,
    /// Compute and storage type of activations (mixed precision).
    pub precision: Precision,
    /// Recompute every BN+ReLU output in backward instead of keeping it
    /// (the plan option `+bn-relu`).
    pub recompute_bn_relu: bool,
    /// The device the model trains on. The planner simulates a step on the
    /// meta device standing for it, so its plans count that device's
    /// workspaces; a model is built on a pool of this device (or its meta).
    pub target: Target,
}

impl ResNetConfig {
    fn new(block: BlockKind, layers: [usize; 4]) -> Self {
        ResNetConfig {
            block,
            layers,
            base_width: 64,
            num_classes: 1000,
            stem: StemKind::ImageNet,
            zero_init_residual: false,
            seed: 0,
            precision: Precision::F32,
            recompute_bn_relu: false,
            target: Target::Cpu,
        }
    }
    pub fn resnet18() -> Self {
        Self::new(BlockKind::Basic, [2, 2, 2, 2])
    }
    pub fn resnet34() -> Self {
        Self::new(BlockKind::Basic, [3, 4, 6, 3])
    }
    pub fn resnet50() -> Self {
        Self::new(BlockKind::Bottleneck, [3, 4, 6, 3])
    }
    pub fn resnet101() -> Self {
        Self::new(BlockKind::Bottleneck, [3, 4, 23, 3])
    }
    pub fn resnet152() -> Self {
        Self::new(BlockKind::Bottleneck, [3, 8, 36, 3])
    }

    /// `resnet18` ... `resnet152`.
    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "resnet18" => Ok(Self::resnet18()),
            "resnet34" => Ok(Self::resnet34()),
            "resnet50" => Ok(Self::resnet50()),
            "resnet101" => Ok(Self::resnet101()),
            "resnet152" => Ok(Self::resnet152()),
            _ => Err(Error::invalid(
                "model",
                format!(
                    "unknown model '{name}' (choose resnet18, resnet34, resnet50, resnet101 or resnet152)"
                ),
            )),
        }
    }

    pub fn expansion(&self) -> usize {
        match self.block {
            BlockKind::Basic => BasicBlock::EXPANSION,
            BlockKind::Bottleneck => Bottleneck::EXPANSION,
        }
    }
}

/// One link of the chain. Variants differ in size, but there is one per
/// block in a `Vec`, so boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Stage {
    Stem(Stem),
    Basic(BasicBlock),
    Bottleneck(Bottleneck),
    Head(Head),
}

/// What a stage's backward needs, by stage kind (one per stage, see above).
#[allow(clippy::large_enum_variant)]
pub enum Saved {
    Stem(StemSaved),
    Basic(BasicSaved),
    Bottleneck(BottleneckSaved),
    Head(HeadSaved),
}

impl Saved {
    /// The stage input alone (what a checkpoint keeps); the rest is freed.
    /// The head keeps only its pooled features, so it has none to give.
    pub fn into_input(self) -> Option<Tensor> {
        match self {
            Saved::Stem(s) => Some(s.into_input()),
            Saved::Basic(s) => Some(s.into_input()),
            Saved::Bottleneck(s) => Some(s.into_input()),
            Saved::Head(_) => None,
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Saved::Stem(s) => s.bytes(),
            Saved::Basic(s) => s.bytes(),
            Saved::Bottleneck(s) => s.bytes(),
            Saved::Head(s) => s.bytes(),
        }
    }
}

impl Stage {
    /// torchvision name: `stem`, `layer2.0`, `head`.
    pub fn name(&self) -> String {
        match self {
            Stage::Stem(_) => "stem".into(),
            Stage::Basic(b) => b.name.to_string(),
            Stage::Bottleneck(b) => b.name.to_string(),
            Stage::Head(_) => "head".into(),
        }
    }

    /// Output (h, w, c) for an (h, w) input; the head gives (1, 1, classes).
    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        match self {
            Stage::Stem(s) => s.out_hwc(h, w),
            Stage::Basic(b) => b.out_hwc(h, w),
            Stage::Bottleneck(b) => b.out_hwc(h, w),
            Stage::Head(hd) => (1, 1, hd.fc.fout),
        }
    }

    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<Saved>)> {
        Ok(match self {
            Stage::Stem(s) => {
                let (y, saved) = s.forward(ctx, x, mode)?;
                (y, saved.map(Saved::Stem))
            }
            Stage::Basic(b) => {
                let (y, saved) = b.forward(ctx, x, mode)?;
                (y, saved.map(Saved::Basic))
            }
            Stage::Bottleneck(b) => {
                let (y, saved) = b.forward(ctx, x, mode)?;
                (y, saved.map(Saved::Bottleneck))
            }
            Stage::Head(hd) => {
                let (y, saved) = hd.forward(ctx, x, mode)?;
                (y, saved.map(Saved::Head))
            }
        })
    }

    /// Consumes `saved`; returns the input gradient (none for the stem,
    /// whose input is the images).
    pub fn backward(
        &mut self,
        ctx: &Ctx<'_>,
        saved: Saved,
        d_out: Tensor,
    ) -> Result<Option<Tensor>> {
        match (self, saved) {
            (Stage::Stem(s), Saved::Stem(sv)) => s.backward(ctx, sv, d_out).map(|()| None),
            (Stage::Basic(b), Saved::Basic(sv)) => b.backward(ctx, sv, d_out).map(Some),
            (Stage::Bottleneck(b), Saved::Bottleneck(sv)) => b.backward(ctx, sv, d_out).map(Some),
            (Stage::Head(hd), Saved::Head(sv)) => hd.backward(ctx, sv, d_out).map(Some),
            (stage, _) => Err(Error::invalid(
                "backward",
                format!("saved state does not belong to stage {}", stage.name()),
            )),
        }
    }

    /// Multiply-add FLOPs (2 per MAC) of the convolutions and the linear
    /// layer in one forward of n (h, w) inputs; the planner's time model.
    pub fn forward_flops(&self, n: usize, h: usize, w: usize) -> f64 {
        use crate::nn::Conv;
        let conv = |c: &Conv, oh: usize, ow: usize| {
            2.0 * (n * oh * ow) as f64 * (c.k * c.k * c.cin * c.cout) as f64
        };
        let (oh, ow, _) = self.out_hwc(h, w);
        match self {
            Stage::Stem(s) => {
                let g = s.conv1.geom(n, h, w);
                conv(&s.conv1, g.oh(), g.ow())
            }
            Stage::Basic(b) => {
                conv(&b.conv1, oh, ow)
                    + conv(&b.conv2, oh, ow)
                    + b.downsample.as_ref().map_or(0.0, |d| conv(&d.conv, oh, ow))
            }
            Stage::Bottleneck(b) => {
                conv(&b.conv1, h, w)
                    + conv(&b.conv2, oh, ow)
                    + conv(&b.conv3, oh, ow)
                    + b.downsample.as_ref().map_or(0.0, |d| conv(&d.conv, oh, ow))
            }
            Stage::Head(hd) => 2.0 * (n * hd.fc.fin * hd.fc.fout) as f64,
        }
    }

    /// Exact bytes a training forward of a batch of n (h, w) inputs keeps
    /// with activations in precision `p`.
    pub fn saved_bytes(&self, n: usize, h: usize, w: usize, p: Precision) -> usize {
        match self {
            Stage::Stem(s) => s.saved_bytes(n, h, w, p),
            Stage::Basic(b) => b.saved_bytes(n, h, w, p),
            Stage::Bottleneck(b) => b.saved_bytes(n, h, w, p),
            Stage::Head(hd) => hd.saved_bytes(n, p),
        }
    }

    /// Every layer of the stage in torchvision's state_dict order, and the
    /// stage's own settings first: the one walk that precision, BN policy,
    /// recomputation and the state_dict visitor share.
    fn walk(&mut self, v: &mut dyn FnMut(LayerMut<'_>)) {
        match self {
            Stage::Stem(s) => {
                v(LayerMut::Stage {
                    recompute_bn_relu: Some(&mut s.recompute_bn_relu),
                });
                v(LayerMut::Conv(&mut s.conv1));
                v(LayerMut::BatchNorm(&mut s.bn1));
            }
            Stage::Basic(b) => {
                v(LayerMut::Stage {
                    recompute_bn_relu: Some(&mut b.recompute_bn_relu),
                });
                v(LayerMut::Conv(&mut b.conv1));
                v(LayerMut::BatchNorm(&mut b.bn1));
                v(LayerMut::Conv(&mut b.conv2));
                v(LayerMut::BatchNorm(&mut b.bn2));
                if let Some(d) = b.downsample.as_mut() {
                    v(LayerMut::Conv(&mut d.conv));
                    v(LayerMut::BatchNorm(&mut d.bn));
                }
            }
            Stage::Bottleneck(b) => {
                v(LayerMut::Stage {
                    recompute_bn_relu: Some(&mut b.recompute_bn_relu),
                });
                v(LayerMut::Conv(&mut b.conv1));
                v(LayerMut::BatchNorm(&mut b.bn1));
                v(LayerMut::Conv(&mut b.conv2));
                v(LayerMut::BatchNorm(&mut b.bn2));
                v(LayerMut::Conv(&mut b.conv3));
                v(LayerMut::BatchNorm(&mut b.bn3));
                if let Some(d) = b.downsample.as_mut() {
                    v(LayerMut::Conv(&mut d.conv));
                    v(LayerMut::BatchNorm(&mut d.bn));
                }
            }
            Stage::Head(hd) => {
                v(LayerMut::Stage {
                    recompute_bn_relu: None,
                });
                v(LayerMut::Linear(&mut hd.fc));
            }
        }
    }
}

/// One item of a stage's walk ([`ResNet::walk_layers`]).
pub enum LayerMut<'a> {
    /// The stage's own settings (the head recomputes nothing).
    Stage {
        recompute_bn_relu: Option<&'a mut bool>,
    },
    Conv(&'a mut Conv),
    BatchNorm(&'a mut BatchNorm),
    Linear(&'a mut Linear),
}

impl LayerMut<'_> {
    /// The state_dict entries of this layer, in torchvision order.
    fn state(self, v: &mut dyn FnMut(StateSlot<'_>)) {
        match self {
            LayerMut::Stage { .. } => {}
            LayerMut::Conv(c) => v(StateSlot::Param {
                param: &mut c.weight,
                torch_shape: vec![c.cout, c.cin, c.k, c.k],
                layout: WeightLayout::Hwio,
            }),
            LayerMut::BatchNorm(b) => {
                let c = b.c;
                v(StateSlot::Param {
                    param: &mut b.weight,
                    torch_shape: vec![c],
                    layout: WeightLayout::Plain,
                });
                v(StateSlot::Param {
                    param: &mut b.bias,
                    torch_shape: vec![c],
                    layout: WeightLayout::Plain,
                });
                v(StateSlot::Buffer {
                    name: format!("{}.running_mean", b.name),
                    tensor: &mut b.running_mean,
                });
                v(StateSlot::Buffer {
                    name: format!("{}.running_var", b.name),
                    tensor: &mut b.running_var,
                });
                v(StateSlot::Count {
                    name: format!("{}.num_batches_tracked", b.name),
                    value: &mut b.num_batches_tracked,
                });
            }
            LayerMut::Linear(l) => {
                let (o, i) = (l.fout, l.fin);
                v(StateSlot::Param {
                    param: &mut l.weight,
                    torch_shape: vec![o, i],
                    layout: WeightLayout::Plain,
                });
                v(StateSlot::Param {
                    param: &mut l.bias,
                    torch_shape: vec![o],
                    layout: WeightLayout::Plain,
                });
            }
        }
    }
}

/// How a parameter's storage relates to the torchvision tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// Same element order as PyTorch.
    Plain,
    /// Conv weight stored (kh, kw, cin, cout); PyTorch's is OIHW.
    Hwio,
}

impl WeightLayout {
    /// `data` (stored in this layout) in PyTorch's element order for `torch_shape`.
    pub fn to_torch(self, data: &[f32], torch_shape: &[usize]) -> Vec<f32> {
        match self {
            WeightLayout::Plain => data.to_vec(),
            WeightLayout::Hwio => crate::ops::conv2d::hwio_to_oihw(
                data,
                torch_shape[0],
                torch_shape[1],
                torch_shape[2],
                torch_shape[3],
            ),
        }
    }

    /// PyTorch-ordered `data` for `torch_shape`, in this layout.
    pub fn from_torch(self, data: &[f32], torch_shape: &[usize]) -> Vec<f32> {
        match self {
            WeightLayout::Plain => data.to_vec(),
            WeightLayout::Hwio => crate::ops::conv2d::oihw_to_hwio(
                data,
                torch_shape[0],
                torch_shape[1],
                torch_shape[2],
                torch_shape[3],
            ),
        }
    }
}

/// One entry of the torchvision state_dict, borrowed from the model.
pub enum StateSlot<'a> {
    Param {
        param: &'a mut Param,
        torch_shape: Vec<usize>,
        layout: WeightLayout,
    },
    /// A BN running statistic (f32, on the model's device).
    Buffer {
        name: String,
        tensor: &'a mut Tensor,
    },
    Count {
        name: String,
        value: &'a mut i64,
    },
}

impl StateSlot<'_> {
    pub fn name(&self) -> &str {
        match self {
            StateSlot::Param { param, .. } => &param.name,
            StateSlot::Buffer { name, .. } | StateSlot::Count { name, .. } => name,
        }
    }
}

/// The network: a chain of stages.
pub struct ResNet {
    pub config: ResNetConfig,
    pub stages: Vec<Stage>,
    /// How batch norm layers behave in training ([`ResNet::set_bn_policy`]).
    pub bn_policy: BnPolicy,
}

impl ResNet {
    /// Builds the network with torchvision's initialisation from `config.seed`.
    pub fn new(pool: &Pool, config: ResNetConfig) -> Result<Self> {
        if config.base_width == 0 || config.num_classes == 0 || config.layers.contains(&0) {
            return Err(Error::invalid(
                "ResNet",
                format!("degenerate configuration {config:?}"),
            ));
        }
        if pool.device().target() != config.target {
            return Err(Error::invalid(
                "ResNet",
                format!(
                    "a model for {:?} cannot be built on a {} pool",
                    config.target,
                    pool.device().name()
                ),
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let mut stages = vec![Stage::Stem(Stem::new(
            pool,
            &mut rng,
            config.base_width,
            config.stem,
        )?)];
        let mut cin = config.base_width;
        for (li, &blocks) in config.layers.iter().enumerate() {
            let planes = config.base_width << li;
            for bi in 0..blocks {
                let stride = if li > 0 && bi == 0 { 2 } else { 1 };
                let name = format!("layer{}.{bi}", li + 1);
                let z = config.zero_init_residual;
                stages.push(match config.block {
                    BlockKind::Basic => Stage::Basic(BasicBlock::new(
                        pool, &mut rng, &name, cin, planes, stride, z,
                    )?),
                    BlockKind::Bottleneck => Stage::Bottleneck(Bottleneck::new(
                        pool, &mut rng, &name, cin, planes, stride, z,
                    )?),
                });
                cin = planes * config.expansion();
            }
        }
        stages.push(Stage::Head(Head::new(
            pool,
            &mut rng,
            cin,
            config.num_classes,
        )?));
        let bn_relu = config.recompute_bn_relu;
        let mut model = ResNet {
            config,
            stages,
            bn_policy: BnPolicy::Batch,
        };
        model.set_recompute_bn_relu(bn_relu);
        Ok(model)
    }

    /// Visit every state_dict entry in torchvision order.
    pub fn visit_state(&mut self, mut v: impl FnMut(StateSlot<'_>)) {
        self.walk_layers(|layer| layer.state(&mut v));
    }

    /// Every stage's settings and layers, stage by stage, each in
    /// torchvision's state_dict order.
    pub fn walk_layers(&mut self, mut v: impl FnMut(LayerMut<'_>)) {
        for s in &mut self.stages {
            s.walk(&mut v);
        }
    }

    /// Visit every trainable parameter.
    pub fn visit_params(&mut self, mut f: impl FnMut(&mut Param)) {
        self.visit_state(|slot| {
            if let StateSlot::Param { param, .. } = slot {
                f(param)
            }
        });
    }

    pub fn zero_grad(&mut self) {
        self.visit_params(|p| p.grad.fill_zero());
    }

    pub fn param_count(&mut self) -> usize {
        let mut n = 0;
        self.visit_params(|p| n += p.value.numel());
        n
    }

    /// Elements of the gradients an optimizer step updates (frozen
    /// parameters left out): what data-parallel training sums.
    pub fn trainable_count(&mut self) -> usize {
        let mut n = 0;
        self.visit_params(|p| {
            if !p.frozen {
                n += p.grad.numel();
            }
        });
        n
    }

    pub fn set_bn_policy(&mut self, policy: BnPolicy) {
        self.bn_policy = policy;
        self.walk_layers(|layer| {
            if let LayerMut::BatchNorm(b) = layer {
                b.weight.frozen = policy == BnPolicy::Frozen;
                b.bias.frozen = policy == BnPolicy::Frozen;
            }
        });
    }

    /// Compute and storage type of activations (see [`Precision`]).
    /// Layers read it from the step's [`Ctx`] ([`ResNet::ctx`]).
    pub fn set_precision(&mut self, p: Precision) {
        self.config.precision = p;
    }

    /// What the layers of a step on `pool` need: the pool, the precision
    /// and the BN policy (one copy, passed down, instead of one per layer).
    pub fn ctx<'a>(&self, pool: &'a Pool) -> Ctx<'a> {
        Ctx {
            pool,
            precision: self.config.precision,
            bn: self.bn_policy,
        }
    }

    pub fn precision(&self) -> Precision {
        self.config.precision
    }

    /// Whether stages recompute their BN+ReLU outputs in backward instead of
    /// keeping them (the head has none).
    pub fn set_recompute_bn_relu(&mut self, on: bool) {
        self.config.recompute_bn_relu = on;
        self.walk_layers(|layer| {
            if let LayerMut::Stage {
                recompute_bn_relu: Some(r),
                ..
            } = layer
            {
                *r = on;
            }
        });
    }

    /// Input (h, w) of every stage for an (h, w) image, and the final shape.
    pub fn stage_inputs(&self, h: usize, w: usize) -> Vec<(usize, usize, usize)> {
        let mut dims = Vec::with_capacity(self.stages.len() + 1);
        let mut cur = (h, w, 3);
        for s in &self.stages {
            dims.push(cur);
            let (oh, ow, oc) = s.out_hwc(cur.0, cur.1);
            cur = (oh, ow, oc);
        }
        dims.push(cur);
        dims
    }

    /// Saved bytes of every stage for a batch of n (h, w) images.
    pub fn saved_bytes_per_stage(&self, n: usize, h: usize, w: usize) -> Vec<usize> {
        let ins = self.stage_inputs(h, w);
        self.stages
            .iter()
            .zip(&ins)
            .map(|(s, &(sh, sw, _))| s.saved_bytes(n, sh, sw, self.config.precision))
            .collect()
    }

    /// Checks an image size is big enough for the network.
    pub fn check_image_size(&self, h: usize, w: usize) -> Result<()> {
        // The stem's conv and pool need at least one output pixel each.
        let min = 1;
        let (sh, sw, _) = self.stage_inputs(h, w)[1];
        if h < 2 || w < 2 || sh < min || sw < min {
            return Err(Error::invalid(
                "image size",
                format!("{h}x{w} is too small for this network"),
            ));
        }
        Ok(())
    }
}
