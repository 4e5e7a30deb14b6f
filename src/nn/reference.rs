//! An independent f64 reference of the whole network's training-mode loss,
//! built from the naive `*_ref` kernels and the configuration alone (not
//! from the stage code). Tests use it for finite-difference checks of the
//! engine's gradients.

use std::collections::HashMap;

use crate::nn::{BlockKind, ResNet, ResNetConfig, StateSlot, StemKind};
use crate::ops::avgpool::avgpool_ref;
use crate::ops::batchnorm::bn_forward_ref;
use crate::ops::conv2d::{ConvGeom, conv2d_ref};
use crate::ops::cross_entropy::cross_entropy_ref;
use crate::ops::linear::linear_ref;
use crate::ops::maxpool::{PoolGeom, maxpool_ref};
use crate::ops::relu::relu_ref;

/// Parameters by torchvision name, as f64 in the engine's storage layout.
pub type RefParams = HashMap<String, Vec<f64>>;

pub fn collect_params(model: &mut ResNet) -> RefParams {
    let mut m = HashMap::new();
    model.visit_state(|slot| {
        if let StateSlot::Param { param, .. } = slot {
            // The reference reads a host copy, whatever the device.
            let host = crate::backend::copy_to_host(&param.value).unwrap_or_default();
            m.insert(param.name.clone(), host.iter().map(|&v| v as f64).collect());
        }
    });
    m
}

/// An NHWC activation with its spatial size.
struct Act {
    v: Vec<f64>,
    h: usize,
    w: usize,
    c: usize,
}

struct Ctx<'a> {
    p: &'a RefParams,
    n: usize,
}

impl Ctx<'_> {
    fn conv(&self, x: &Act, name: &str, cout: usize, k: usize, stride: usize, pad: usize) -> Act {
        let g = ConvGeom {
            n: self.n,
            h: x.h,
            w: x.w,
            cin: x.c,
            cout,
            kh: k,
            kw: k,
            stride,
            pad,
        };
        Act {
            v: conv2d_ref(&x.v, &self.p[&format!("{name}.weight")], &g),
            h: g.oh(),
            w: g.ow(),
            c: cout,
        }
    }

    fn bn(&self, x: Act, name: &str, relu: bool) -> Act {
        let v = bn_forward_ref(
            &x.v,
            &self.p[&format!("{name}.weight")],
            &self.p[&format!("{name}.bias")],
            None,
            x.c,
            1e-5,
            relu,
        );
        Act { v, ..x }
    }
}

/// Mean cross-entropy of the network on `x` (n, h, w, 3) in training mode.
pub fn loss_ref(
    config: &ResNetConfig,
    p: &RefParams,
    x: &[f64],
    n: usize,
    h: usize,
    w: usize,
    labels: &[usize],
) -> f64 {
    let cx = Ctx { p, n };
    let base = config.base_width;
    let mut a = Act {
        v: x.to_vec(),
        h,
        w,
        c: 3,
    };
    // Written out here rather than asked of `StemKind`, so the reference
    // stays independent of the stage code.
    let (k, stride, pad, maxpool) = match config.stem {
        StemKind::ImageNet => (7, 2, 3, true),
        StemKind::Small => (3, 1, 1, false),
    };
    a = cx.bn(cx.conv(&a, "conv1", base, k, stride, pad), "bn1", true);
    if maxpool {
        let g = PoolGeom {
            n,
            h: a.h,
            w: a.w,
            c: a.c,
            k: 3,
            stride: 2,
            pad: 1,
        };
        a = Act {
            v: maxpool_ref(&a.v, &g).0,
            h: g.oh(),
            w: g.ow(),
            c: a.c,
        };
    }
    let exp = config.expansion();
    for (li, &blocks) in config.layers.iter().enumerate() {
        let planes = base << li;
        for bi in 0..blocks {
            let stride = if li > 0 && bi == 0 { 2 } else { 1 };
            let name = format!("layer{}.{bi}", li + 1);
            let cout = planes * exp;
            let identity = if stride != 1 || a.c != cout {
                cx.bn(
                    cx.conv(&a, &format!("{name}.downsample.0"), cout, 1, stride, 0),
                    &format!("{name}.downsample.1"),
                    false,
                )
            } else {
                Act {
                    v: a.v.clone(),
                    ..a
                }
            };
            let z = match config.block {
                BlockKind::Basic => {
                    let t = cx.bn(
                        cx.conv(&a, &format!("{name}.conv1"), planes, 3, stride, 1),
                        &format!("{name}.bn1"),
                        true,
                    );
                    cx.bn(
                        cx.conv(&t, &format!("{name}.conv2"), planes, 3, 1, 1),
                        &format!("{name}.bn2"),
                        false,
                    )
                }
                BlockKind::Bottleneck => {
                    let t = cx.bn(
                        cx.conv(&a, &format!("{name}.conv1"), planes, 1, 1, 0),
                        &format!("{name}.bn1"),
                        true,
                    );
                    let t = cx.bn(
                        cx.conv(&t, &format!("{name}.conv2"), planes, 3, stride, 1),
                        &format!("{name}.bn2"),
                        true,
                    );
                    cx.bn(
                        cx.conv(&t, &format!("{name}.conv3"), cout, 1, 1, 0),
                        &format!("{name}.bn3"),
                        false,
                    )
                }
            };
            let sum: Vec<f64> = z.v.iter().zip(&identity.v).map(|(a, b)| a + b).collect();
            a = Act {
                v: relu_ref(&sum),
                ..z
            };
        }
    }
    let pooled = avgpool_ref(&a.v, a.h * a.w, a.c);
    let logits = linear_ref(
        &pooled,
        &p["fc.weight"],
        &p["fc.bias"],
        n,
        a.c,
        config.num_classes,
    );
    cross_entropy_ref(&logits, labels, config.num_classes, 0.0)
}
