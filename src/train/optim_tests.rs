//! The tests of src/train/optim.rs: AdamW against its formulas, the flat and fused steps, the
//! clip, saving and loading the state, the learning-rate schedule.

use super::*;

/// PyTorch's default betas and eps, with `weight_decay`.
fn pytorch_defaults(weight_decay: f64) -> AdamWConfig {
    AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay,
    }
}

#[test]
fn a_non_finite_optimizer_state_is_refused_naming_the_tensor_and_changes_nothing() {
    let good = Tensor::from_slice(&[1.0f32, 2.0]);
    let bad = Tensor::from_slice(&[1.0f32, f32::INFINITY]);
    let norm = Tensor::from_slice(&[1.0f32]);
    let cfg = pytorch_defaults(0.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    let saved = [("w".to_string(), &bad), ("n".to_string(), &norm)];
    AdamW::new(&saved, Device::Cpu, cfg).save(&path).unwrap();
    let mut opt = AdamW::new(
        &[("w".into(), &good), ("n".into(), &norm)],
        Device::Cpu,
        cfg,
    );
    let err = format!("{:#}", opt.load(&path, 3).unwrap_err());
    assert!(
        err.contains("tensor \"master.w\" holds a non-finite value"),
        "{err}"
    );
    assert_eq!(opt.step, 0);
    assert_eq!(
        Vec::<f32>::try_from(&opt.master).unwrap(),
        vec![1.0, 2.0, 1.0]
    );
    let nan = Tensor::from_slice(&[f32::NAN]);
    assert!(!all_finite(&nan).unwrap() && all_finite(&good).unwrap());
    assert!(all_finite(&Tensor::zeros([0], (Kind::Float, Device::Cpu))).unwrap());
}

#[test]
fn schedule_warms_up_then_decays_to_the_floor() {
    let lr = |s| lr_at(s, 100, 10, 1.0, 0.1);
    assert!((lr(0) - 0.1).abs() < 1e-12);
    assert!((lr(9) - 1.0).abs() < 1e-12);
    assert!((lr(10) - 1.0).abs() < 1e-12);
    assert!(lr(50) < lr(20) && lr(50) > 0.1);
    assert!((lr(100) - 0.1).abs() < 1e-12);
    assert!((lr(500) - 0.1).abs() < 1e-12);
}

#[test]
fn adamw_matches_the_formula_and_round_trips() {
    let p = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
    let params = vec![("w".to_string(), &p)];
    let cfg = pytorch_defaults(0.1);
    let mut opt = AdamW::new(&params, Device::Cpu, cfg);
    let g = Tensor::from_slice(&[0.5f32, 0.25]);
    opt.update(&g, 0.01).unwrap();
    opt.write_params(&params).unwrap();
    // step 1: m/(1-b1) = g, v/(1-b2) = g^2 -> update = lr * g/|g| = lr * sign(g)
    let want = [
        1.0 * (1.0 - 0.01 * 0.1) - 0.01,
        -2.0 * (1.0 - 0.01 * 0.1) - 0.01,
    ];
    let got = Vec::<f32>::try_from(&p.detach()).unwrap();
    for (a, b) in got.iter().zip(want) {
        assert!((*a as f64 - b).abs() < 1e-6, "{got:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    opt.save(&path).unwrap();
    let mut other = AdamW::new(&params, Device::Cpu, cfg);
    other.load(&path, opt.step).unwrap();
    opt.update(&g, 0.01).unwrap();
    other.update(&g, 0.01).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(&opt.master).unwrap(),
        Vec::<f32>::try_from(&other.master).unwrap()
    );
    // flattened gradients survive the reset of the parameters' gradients
    (&p * Tensor::from_slice(&[2.0f32, 3.0]))
        .sum(Kind::Float)
        .backward();
    let flat = AdamW::flatten_grads(&params);
    assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), vec![2.0, 3.0]);
    assert!(!p.grad().defined(), "the gradient is dropped");
    // the next backward pass starts from nothing, not from the old gradient
    (&p * Tensor::from_slice(&[5.0f32, 7.0]))
        .sum(Kind::Float)
        .backward();
    assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), vec![5.0, 7.0]);
    assert_eq!(
        Vec::<f32>::try_from(&AdamW::flatten_grads(&params)).unwrap(),
        vec![5.0, 7.0]
    );
    let mut big = Tensor::from_slice(&[3.0f32, 4.0]);
    assert_eq!(AdamW::clip(&mut big, 1.0), 5.0);
    assert!((big.norm().double_value(&[]) - 1.0).abs() < 1e-5);
    // below the limit, or no limit: unchanged, the norm still reported
    let mut small = Tensor::from_slice(&[0.3f32, 0.4]);
    let norm = AdamW::clip_on_device(&mut small, 1.0);
    assert!((norm.double_value(&[]) - 0.5).abs() < 1e-6);
    assert_eq!(Vec::<f32>::try_from(&small).unwrap(), vec![0.3, 0.4]);
    let mut any = Tensor::from_slice(&[30.0f32, 40.0]);
    assert_eq!(AdamW::clip(&mut any, 0.0), 50.0);
    assert_eq!(Vec::<f32>::try_from(&any).unwrap(), vec![30.0, 40.0]);
}

/// AdamW as the formulas read, in f64 on the host, with the global-norm clip in front.
struct Reference {
    cfg: AdamWConfig,
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    /// The magnitude of the terms that summed to `m` (the scale of its rounding errors
    /// when they cancel to about zero)
    m_terms: Vec<f64>,
    t: i32,
}

impl Reference {
    /// One step; returns the gradient norm before clipping.
    fn step(&mut self, g: &[f32], lr: f64, max_norm: f64) -> f64 {
        let c = self.cfg;
        self.t += 1;
        let norm = g.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let scale = if max_norm > 0.0 && norm > max_norm {
            max_norm / (norm + 1e-6)
        } else {
            1.0
        };
        let bias1 = 1.0 - c.beta1.powi(self.t);
        let bias2 = 1.0 - c.beta2.powi(self.t);
        for i in 0..self.p.len() {
            let g = g[i] as f64 * scale;
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
            self.m_terms[i] = c.beta1 * self.m_terms[i] + (1.0 - c.beta1) * g.abs();
            self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
            self.p[i] *= 1.0 - lr * c.weight_decay;
            let m_hat = self.m[i] / bias1;
            let v_hat = self.v[i] / bias2;
            self.p[i] -= lr * m_hat / (v_hat.sqrt() + c.eps);
        }
        norm
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_device(Device::Cpu).to_kind(Kind::Float).reshape([-1])).unwrap()
}

/// Every element within `rel` of the reference, relative to `scale` (its magnitude, or
/// that of the terms it sums).
fn assert_close(what: &str, step: usize, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let err = (a as f64 - b).abs() / scale[i];
        assert!(
            err <= rel,
            "step {step}: {what}[{i}] = {a}, the reference {b} (relative error {err:.2e})"
        );
    }
}

#[test]
fn fused_update_matches_an_elementwise_adamw() {
    tch::manual_seed(7);
    // two parameters (one matrix, one vector) of 317 elements, of magnitude 0.5 to 2
    let init = |shape: &[i64]| {
        let u = Tensor::rand(shape, (Kind::Float, Device::Cpu)) * 1.5 + 0.5;
        let sign = Tensor::rand(shape, (Kind::Float, Device::Cpu)).gt(0.5);
        u.where_self(&sign, &-&u)
    };
    let a = init(&[12, 20]).set_requires_grad(true);
    let b = init(&[77]).set_requires_grad(true);
    let params = vec![("a".to_string(), &a), ("b".to_string(), &b)];
    // a large eps and a small beta2 make the place of eps in the denominator matter
    let cfg = AdamWConfig {
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-3,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(&params, Device::Cpu, cfg);
    let start: Vec<f64> = host(&opt.master).iter().map(|&x| x as f64).collect();
    let n = start.len();
    assert_eq!(n, 317);
    let mut reference = Reference {
        cfg,
        p: start,
        m: vec![0.0; n],
        v: vec![0.0; n],
        m_terms: vec![0.0; n],
        t: 0,
    };
    // (gradient size, lr, max_norm): clipped (norm about 18 > 5) or not (norm about 1.8
    // < 5, or no limit), a step with lr = 0, and plain `update` (no clip) at the end
    let steps = [
        (1.0, 0.05, 5.0),
        (0.1, 0.05, 5.0),
        (1.0, 0.03, 5.0),
        (1.0, 0.0, 5.0),
        (0.1, 0.02, 5.0),
        (1.0, 0.02, 0.0),
        (1.0, 0.01, f64::NAN),
    ];
    let (mut clipped, mut unclipped) = (0, 0);
    for (k, &(size, lr, max_norm)) in steps.iter().enumerate() {
        let mut grad = Tensor::randn([n as i64], (Kind::Float, Device::Cpu)) * size;
        let g = host(&grad);
        let before = host(&opt.master);
        let plain = max_norm.is_nan();
        let want_norm = reference.step(&g, lr, if plain { 0.0 } else { max_norm });
        if !plain && max_norm > 0.0 && want_norm > max_norm {
            clipped += 1;
        } else {
            unclipped += 1;
        }
        if plain {
            opt.update(&grad, lr).unwrap();
        } else {
            let norm = opt.update_clipped(&mut grad, lr, max_norm).unwrap();
            let norm = norm.double_value(&[]);
            assert!(
                (norm - want_norm).abs() <= 1e-6 * want_norm,
                "{norm} {want_norm}"
            );
        }
        assert_eq!(opt.step, k as u64 + 1);
        let after = host(&opt.master);
        if lr == 0.0 {
            assert_eq!(before, after, "lr = 0 changed the weights");
        } else {
            assert!(before != after);
        }
        let r = &reference;
        let abs = |x: &[f64]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
        assert_close("master", k, &after, &r.p, &abs(&r.p), 1e-6);
        assert_close("exp_avg", k, &host(&opt.exp_avg), &r.m, &r.m_terms, 1e-6);
        assert_close("exp_avg_sq", k, &host(&opt.exp_avg_sq), &r.v, &r.v, 1e-6);
    }
    assert!(clipped >= 2 && unclipped >= 3, "{clipped} {unclipped}");
    // the weights reach the parameters
    opt.write_params(&params).unwrap();
    let mut written = host(&a);
    written.extend(host(&b));
    let scale: Vec<f64> = reference.p.iter().map(|v| v.abs()).collect();
    assert_close("written", steps.len(), &written, &reference.p, &scale, 1e-6);
}

#[test]
fn update_clipped_returns_the_norm_before_clipping() {
    let p = Tensor::from_slice(&[0.0f32; 4]);
    let params = vec![("w".to_string(), &p)];
    let cfg = pytorch_defaults(0.0);
    let mut opt = AdamW::new(&params, Device::Cpu, cfg);
    // norm 13, clipped to 1: the gradient is left scaled to a norm of about 1
    let mut grad = Tensor::from_slice(&[3.0f32, 4.0, 12.0, 0.0]);
    let norm = opt.update_clipped(&mut grad, 1e-3, 1.0).unwrap();
    assert!((norm.double_value(&[]) - 13.0).abs() < 1e-5);
    assert!((grad.norm().double_value(&[]) - 1.0).abs() < 1e-5);
    // below the limit and without a limit: the norm, the gradient unchanged
    let mut grad = Tensor::from_slice(&[0.3f32, 0.4, 0.0, 0.0]);
    let norm = opt.update_clipped(&mut grad, 1e-3, 1.0).unwrap();
    assert!((norm.double_value(&[]) - 0.5).abs() < 1e-6);
    assert_eq!(host(&grad), vec![0.3, 0.4, 0.0, 0.0]);
    let mut grad = Tensor::from_slice(&[30.0f32, 40.0, 0.0, 0.0]);
    let norm = opt.update_clipped(&mut grad, 1e-3, 0.0).unwrap();
    assert!((norm.double_value(&[]) - 50.0).abs() < 1e-4);
    assert_eq!(host(&grad), vec![30.0, 40.0, 0.0, 0.0]);
    assert_eq!(opt.step, 3);
}

#[test]
fn mismatched_tensors_are_errors() {
    let p = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    let params = vec![("w".to_string(), &p)];
    let cfg = pytorch_defaults(0.0);
    let mut opt = AdamW::new(&params, Device::Cpu, cfg);
    let short = Tensor::from_slice(&[1.0f32, 2.0]);
    let err = opt.update(&short, 0.1).unwrap_err().to_string();
    assert!(err.contains("gradient") && err.contains("[2]"), "{err}");
    let double = Tensor::from_slice(&[1.0f64, 2.0, 3.0]);
    let err = opt.update(&double, 0.1).unwrap_err().to_string();
    assert!(err.contains("Double"), "{err}");
    assert_eq!(opt.step, 0, "a failed update counts no step");
    // past the checks, libtorch's own error comes back through the shim
    let step = Tensor::from_slice(&[1.0f32]);
    let tensors = AdamWTensors {
        param: &opt.master,
        grad: &double,
        exp_avg: &opt.exp_avg,
        exp_avg_sq: &opt.exp_avg_sq,
        state_step: &step,
        grad_scale: None,
    };
    let rates = AdamWRates {
        lr: 0.1,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        weight_decay: cfg.weight_decay,
        eps: cfg.eps,
    };
    // SAFETY: every tensor has three contiguous elements
    let err = unsafe { crate::aten_ext::fused_adamw_unchecked(&tensors, &rates) }
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("fused AdamW (at::_fused_adamw_): "),
        "{err}"
    );
    assert_eq!(host(&opt.master), vec![1.0, 2.0, 3.0]);
}

/// On a GPU: the optimizer step on the fused kernel gives the flat path's numbers: bf16
/// parameters (sizes the kernel takes by vectors and one element at a time), four steps
/// with weight decay, one of them clipped, one with a parameter that got no gradient; the
/// master weights and moments within float32 rounding, the parameters their rounding.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_fused_step_equals_the_flat_path() {
    let runtime = crate::runtime::TorchRuntime::init();
    assert!(
        runtime.cuda_devices() > 0,
        "no CUDA device: {:?}",
        runtime.cuda
    );
    let dev = Device::Cuda(0);
    let kernels = runtime
        .fused_kernels(true, dev)
        .expect("the fused kernels load");
    tch::manual_seed(3);
    let shapes: [&[i64]; 4] = [&[256, 64], &[64], &[333, 3], &[7]];
    let start: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::randn(*s, (Kind::Float, dev)).to_kind(Kind::BFloat16))
        .collect();
    let copy = || -> Vec<Tensor> {
        start
            .iter()
            .map(|t| t.copy().set_requires_grad(true))
            .collect()
    };
    let (flat_params, fused_params) = (copy(), copy());
    let named = |ps: &[Tensor]| -> Vec<(String, Tensor)> {
        ps.iter()
            .enumerate()
            .map(|(i, p)| (format!("p{i}"), p.shallow_clone()))
            .collect()
    };
    let (flat_named, fused_named) = (named(&flat_params), named(&fused_params));
    fn refs(n: &[(String, Tensor)]) -> Vec<(String, &Tensor)> {
        n.iter().map(|(k, t)| (k.clone(), t)).collect()
    }
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut flat = AdamW::new(&refs(&flat_named), dev, cfg);
    let mut fused = AdamW::new(&refs(&fused_named), dev, cfg);
    for step in 0..4 {
        // the same gradients into both (step 1 large: clipped; step 2: none for p1)
        let size = if step == 1 { 30.0 } else { 0.05 };
        let grads: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(*s, (Kind::Float, dev)) * size)
            .collect();
        for ps in [&flat_params, &fused_params] {
            let loss = ps
                .iter()
                .zip(&grads)
                .enumerate()
                .filter(|(i, _)| step != 2 || *i != 1)
                .map(|(_, (p, g))| (p.to_kind(Kind::Float) * g).sum(Kind::Float))
                .fold(Tensor::zeros([], (Kind::Float, dev)), |a, b| a + b);
            loss.backward();
        }
        let mut g = AdamW::flatten_grads(&refs(&flat_named));
        let want = flat
            .update_clipped(&mut g, 1e-2, 1.0)
            .unwrap()
            .double_value(&[]);
        flat.write_params(&refs(&flat_named)).unwrap();
        let got = fused
            .fused_step(&refs(&fused_named), &kernels, 1e-2, 1.0)
            .unwrap()
            .double_value(&[]);
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "step {step}: norm {got} against {want}"
        );
        assert!(
            fused_params.iter().all(|p| !p.grad().defined()),
            "gradients kept"
        );
        for (what, a, b) in [
            ("master weights", &fused.master, &flat.master),
            ("first moments", &fused.exp_avg, &flat.exp_avg),
            ("second moments", &fused.exp_avg_sq, &flat.exp_avg_sq),
        ] {
            let scale = b.abs().max().double_value(&[]);
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-5 * scale,
                "step {step}: {what} {diff} off of {scale}"
            );
        }
        for (i, (p, q)) in fused_params.iter().zip(&flat_params).enumerate() {
            let diff = (p.to_kind(Kind::Float) - q.to_kind(Kind::Float))
                .abs()
                .max()
                .double_value(&[]);
            let scale = q.to_kind(Kind::Float).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-2 * scale,
                "step {step}: parameter {i} {diff} off of {scale}"
            );
        }
    }
    assert_eq!((fused.step, flat.step), (4, 4));
}
