//! Tests of the sparse MoE block: against transformers' blocks (fixtures made by
//! tests/fixtures/make_moe_blocks.py), against a plain per-token computation, and the refusals.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};
use tch::{Device, Kind, Tensor};

use super::*;
use crate::model::weights::WeightFiles;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/moe_targets")
}

/// The text settings of a fixture's config.json, its MoE family and layer count.
fn text_config(dir: &Path) -> (MoeFamily, Map<String, Value>, i64) {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let top: Map<String, Value> = serde_json::from_str(&text).expect("config JSON");
    let model_type = top["model_type"].as_str().expect("model_type").to_string();
    let c = match top.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        _ => top,
    };
    let family = MoeFamily::of_model_type(&model_type).expect("a MoE model type");
    let layers = c["num_hidden_layers"].as_i64().expect("num_hidden_layers");
    (family, c, layers)
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Loads the sparse block of layer `l` from the weights in `dir`.
fn load_block(
    dir: &Path,
    settings: &MoeSettings,
    hidden: i64,
    l: i64,
    (kind, device): (Kind, Device),
) -> SparseMoe {
    let files = WeightFiles::open(dir).expect("weights");
    let load = |name: &str, shape: &[i64]| files.load(name, shape, kind, device);
    let contains = |name: &str| files.contains(name);
    let source = TensorSource {
        load: &load,
        contains: &contains,
    };
    SparseMoe::load(
        &format!("model.layers.{l}.mlp"),
        settings.shape(hidden),
        &source,
    )
    .expect("block loads")
}

/// Every sparse block of the fixture `name`, its weights read from `weights` (the same model
/// in either layout), matches transformers' block alone in float32 within 1e-4, on both
/// expert paths, with the same router choices (ties included); returns the tied tokens seen.
fn check_blocks(name: &str, weights: &str, layout: ExpertLayout) -> usize {
    let dir = fixtures().join(name);
    let (family, c, layers) = text_config(&dir);
    let settings = MoeSettings::from_text_config(family, &c, layers).expect("settings");
    let hidden = c["hidden_size"].as_i64().expect("hidden_size");
    let info: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("json"))
            .expect("reference.json");
    let sparse: Vec<i64> = (0..layers).filter(|&l| settings.is_sparse(l)).collect();
    assert_eq!(
        json!(sparse),
        info["sparse_layers"],
        "{name}: sparse layers"
    );
    let refs = read(&dir.join("blocks.safetensors"));
    let wdir = fixtures().join(weights);
    let mut ties = 0;
    for l in sparse {
        let files = WeightFiles::open(&wdir).expect("weights");
        let contains = |n: &str| files.contains(n);
        let load = |_: &str, _: &[i64]| -> Result<Tensor> { bail!("unused") };
        let source = TensorSource {
            load: &load,
            contains: &contains,
        };
        let prefix = format!("model.layers.{l}.mlp");
        assert_eq!(
            ExpertLayout::detect(&prefix, &source).expect("layout"),
            layout
        );
        let block = load_block(&wdir, &settings, hidden, l, (Kind::Float, Device::Cpu));
        let r = |k: &str| &refs[&format!("l{l}.{k}")];
        let x = r("x");
        let routing = block.route(&x.view([-1, hidden]));
        assert!(max_diff(&routing.logits, r("router_logits")) < 1e-5);
        assert!(max_diff(&routing.weights, r("router_weights")) < 1e-6);
        assert_eq!(
            routing.experts,
            *r("router_indices"),
            "{name} layer {l}: choices"
        );
        for gemm in [ExpertGemm::Grouped, ExpertGemm::PerExpert] {
            let diff = max_diff(&block.forward_with(x, gemm), r("out"));
            assert!(diff < 1e-4, "{name} ({weights}) layer {l} {gemm:?}: {diff}");
        }
        ties += tied_tokens(&block, &x.view([-1, hidden]));
    }
    ties
}

/// Tokens whose k-th largest router probability is shared by more experts than the choice
/// keeps: where topk's tie-breaking decides.
fn tied_tokens(block: &SparseMoe, x: &Tensor) -> usize {
    tied_rows(block, x).sum(Kind::Int64).int64_value(&[]) as usize
}

/// [T] bool: the tokens of [`tied_tokens`].
fn tied_rows(block: &SparseMoe, x: &Tensor) -> Tensor {
    let probs = block.route(x).logits.softmax(-1, Kind::Float);
    let kth = probs
        .topk(block.top_k, -1, true, true)
        .0
        .narrow(1, block.top_k - 1, 1);
    let equal = probs
        .eq_tensor(&kth)
        .sum_dim_intlist(-1, false, Kind::Int64);
    let above = probs
        .gt_tensor(&kth)
        .sum_dim_intlist(-1, false, Kind::Int64);
    equal.gt_tensor(&(above.neg() + block.top_k))
}

#[test]
fn qwen3_moe_blocks_match_transformers_in_both_layouts() {
    check_blocks("qwen3_moe_norm", "qwen3_moe_norm", ExpertLayout::PerExpert);
    check_blocks(
        "qwen3_moe_norm",
        "qwen3_moe_norm_fused",
        ExpertLayout::Fused,
    );
    // norm_topk_prob false, four experts with equal router rows: the choices among them are
    // topk's tie-breaking, and must be transformers'
    let ties = check_blocks(
        "qwen3_moe_step2",
        "qwen3_moe_step2",
        ExpertLayout::PerExpert,
    );
    assert!(
        ties > 0,
        "the fixture should hold tied router probabilities"
    );
}

#[test]
fn qwen3_5_moe_blocks_with_the_shared_expert_match_transformers_in_both_layouts() {
    check_blocks("qwen3_5_moe", "qwen3_5_moe", ExpertLayout::PerExpert);
    check_blocks("qwen3_5_moe", "qwen3_5_moe_fused", ExpertLayout::Fused);
}

/// In bf16 the block runs the operations transformers' default path runs (router, softmax in
/// float32, topk, grouped products, one rounding of the sum over choices), so on the CPU its
/// output is transformers' to the bit.
#[test]
fn bf16_blocks_equal_transformers_bit_for_bit_on_the_cpu() {
    for name in ["qwen3_moe_norm", "qwen3_moe_step2", "qwen3_5_moe"] {
        let dir = fixtures().join(name);
        let (family, c, layers) = text_config(&dir);
        let settings = MoeSettings::from_text_config(family, &c, layers).expect("settings");
        let hidden = c["hidden_size"].as_i64().expect("hidden_size");
        let refs = read(&dir.join("blocks.safetensors"));
        for l in (0..layers).filter(|&l| settings.is_sparse(l)) {
            let block = load_block(&dir, &settings, hidden, l, (Kind::BFloat16, Device::Cpu));
            assert_eq!(block.gate_up.kind(), Kind::BFloat16);
            let out = block.forward(&refs[&format!("l{l}.x_bf16")]);
            let want = &refs[&format!("l{l}.out_bf16")];
            assert_eq!(out, *want, "{name} layer {l}: {}", max_diff(&out, want));
        }
    }
}

/// A block of random weights: `e` experts of width `i` over hidden size `h`, routing `k`;
/// the router rows of experts 1, 3 and 5 equal (ties), with a shared expert if asked.
fn random_block(kind: Kind, e: i64, k: i64, h: i64, i: i64, shared: bool) -> SparseMoe {
    tch::manual_seed(7);
    let opts = (kind, Device::Cpu);
    let router = Tensor::randn([e, h], opts);
    let row = router.get(1);
    for tied in [3, 5] {
        router.get(tied).copy_(&row);
    }
    let mlp = |width: i64| Mlp {
        gate_proj: Tensor::randn([width, h], opts) * 0.3,
        up_proj: Tensor::randn([width, h], opts) * 0.3,
        down_proj: Tensor::randn([h, width], opts) * 0.3,
        fused: None,
    };
    SparseMoe {
        router,
        gate_up: Tensor::randn([e, 2 * i, h], opts) * 0.3,
        down: Tensor::randn([e, h, i], opts) * 0.3,
        top_k: k,
        norm_topk_prob: true,
        shared: shared.then(|| SharedExpert {
            mlp: mlp(2 * i),
            gate: Tensor::randn([1, h], opts),
        }),
    }
}

/// The block computed token by token in float64 from the router's choices: each chosen
/// expert's SwiGLU on the token alone, times its weight (recomputed here from the logits).
fn per_token_reference(block: &SparseMoe, x: &Tensor) -> Tensor {
    let routing = block.route(x);
    let f = |t: &Tensor| t.to_kind(Kind::Double);
    let probs = f(&routing.logits).softmax(-1, Kind::Double);
    let i = block.down.size()[2];
    let rows: Vec<Tensor> = (0..x.size()[0])
        .map(|t| {
            let xt = f(&x.get(t));
            let chosen: Vec<i64> = (0..block.top_k)
                .map(|c| routing.experts.int64_value(&[t, c]))
                .collect();
            let total: f64 = chosen.iter().map(|&e| probs.double_value(&[t, e])).sum();
            let mut out = xt.zeros_like();
            for &e in &chosen {
                let w =
                    probs.double_value(&[t, e]) / if block.norm_topk_prob { total } else { 1.0 };
                let gu = f(&block.gate_up.get(e)).mv(&xt);
                let a = gu.narrow(0, 0, i).silu() * gu.narrow(0, i, i);
                out += f(&block.down.get(e)).mv(&a) * w;
            }
            if let Some(s) = &block.shared {
                let m = &s.mlp;
                let a = f(&m.gate_proj).mv(&xt).silu() * f(&m.up_proj).mv(&xt);
                let g = f(&s.gate).mv(&xt).sigmoid();
                out += f(&m.down_proj).mv(&a) * g;
            }
            out
        })
        .collect();
    Tensor::stack(&rows, 0)
}

/// How many experts receive no token.
fn idle_experts(block: &SparseMoe, x: &Tensor) -> i64 {
    let counts = block
        .route(x)
        .experts
        .reshape([-1])
        .bincount(None::<Tensor>, block.num_experts());
    counts.eq(0).sum(Kind::Int64).int64_value(&[])
}

/// The grouped path (sorting, group boundaries, grouped products, scatter and sum) equals the
/// plain per-token computation: few tokens (experts with no token), many tokens, tied router
/// rows, with and without the shared expert, in float32 on both paths and in float64 (which
/// `_grouped_mm` refuses: the per-expert path).
#[test]
fn grouped_experts_equal_a_per_token_computation() {
    for shared in [false, true] {
        // float64 blocks still route in float32 (softmax in float32, as transformers)
        for (kind, tol) in [(Kind::Float, 1e-5), (Kind::Double, 1e-6)] {
            let block = random_block(kind, 8, 2, 16, 8, shared);
            for tokens in [3, 40] {
                let x = Tensor::randn([tokens, 16], (kind, Device::Cpu));
                // make some tokens tie: a large multiple of the tied router row dominates
                let _ = x.narrow(0, 0, 2).g_add_(&(block.router.get(1) * 3.0));
                assert!(tied_tokens(&block, &x) >= 2, "tokens 0 and 1 tie");
                let routing = block.route(&x);
                let chosen = routing.experts.narrow(0, 0, 2);
                let tied = [1i64, 3, 5];
                for c in Vec::<i64>::try_from(chosen.reshape([-1])).expect("ids") {
                    assert!(
                        tied.contains(&c),
                        "tokens 0, 1 choose among the tied experts"
                    );
                }
                if tokens == 3 {
                    assert!(idle_experts(&block, &x) > 0);
                }
                let want = per_token_reference(&block, &x);
                let paths: &[ExpertGemm] = match kind {
                    Kind::Float => &[ExpertGemm::Grouped, ExpertGemm::PerExpert],
                    _ => &[ExpertGemm::PerExpert],
                };
                assert_eq!(ExpertGemm::for_shape(kind, 16, 8), paths[0]);
                // relative to the outputs' scale: libtorch's random generator is shared by the
                // tests running beside this one, so the draws and the outputs' size differ from
                // run to run, and float32 rounds to about 1e-7 of that size (an absolute 1e-5
                // failed once with other tests in parallel)
                let scale = 1.0 + want.abs().max().double_value(&[]);
                for &gemm in paths {
                    let diff = max_diff(&block.forward_with(&x, gemm), &want);
                    assert!(
                        diff < tol * scale,
                        "{kind:?} {gemm:?} {tokens} tokens: {diff} (outputs up to {scale})"
                    );
                }
            }
        }
    }
}

#[test]
fn inputs_of_any_leading_shape_and_no_tokens_keep_their_shape() {
    let block = random_block(Kind::Float, 8, 2, 16, 8, true);
    let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
    let flat = block.forward(&x.view([10, 16]));
    assert_eq!(block.forward(&x), flat.view([2, 5, 16]));
    let empty = Tensor::zeros([1, 0, 16], (Kind::Float, Device::Cpu));
    assert_eq!(block.forward(&empty).size(), vec![1, 0, 16]);
}

#[test]
fn the_grouped_path_is_chosen_only_for_dtypes_and_widths_it_takes() {
    use ExpertGemm::*;
    assert_eq!(ExpertGemm::for_shape(Kind::BFloat16, 2048, 512), Grouped);
    assert_eq!(ExpertGemm::for_shape(Kind::BFloat16, 2048, 36), PerExpert);
    assert_eq!(ExpertGemm::for_shape(Kind::Float, 32, 8), Grouped);
    assert_eq!(ExpertGemm::for_shape(Kind::Float, 30, 8), PerExpert);
    assert_eq!(ExpertGemm::for_shape(Kind::Double, 32, 8), PerExpert);
    // the alignment rule is libtorch's: it refuses what for_shape sends to PerExpert
    let x = Tensor::randn([4, 30], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([2, 8, 30], (Kind::Float, Device::Cpu));
    let ends = Tensor::from_slice(&[1i32, 4]);
    assert!(x
        .f_internal_grouped_mm(&w.transpose(1, 2), Some(&ends), None, None::<Kind>)
        .is_err());
}

fn qwen3_config(extra: Value) -> Map<String, Value> {
    let mut c = json!({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 8, "hidden_act": "silu",
    });
    if let (Value::Object(c), Value::Object(extra)) = (&mut c, extra) {
        c.extend(extra);
    }
    match c {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn refusal(c: Map<String, Value>, family: MoeFamily) -> String {
    match MoeSettings::from_text_config(family, &c, 4) {
        Ok(s) => panic!("accepted {s:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn settings_follow_transformers_defaults_and_sparse_layer_rule() {
    let s = MoeSettings::from_text_config(MoeFamily::Qwen3Moe, &qwen3_config(json!({})), 4)
        .expect("valid");
    assert_eq!(
        s.num_experts, 8,
        "num_local_experts is what transformers 5 writes"
    );
    assert!(!s.norm_topk_prob);
    assert_eq!(s.shared_expert_intermediate_size, None);
    assert!((0..4).all(|l| s.is_sparse(l)));
    let c = qwen3_config(json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}));
    let s = MoeSettings::from_text_config(MoeFamily::Qwen3Moe, &c, 4).expect("valid");
    let sparse: Vec<i64> = (0..4).filter(|&l| s.is_sparse(l)).collect();
    assert_eq!(sparse, vec![1]);
    // Qwen3.5-MoE: always normalised, every layer sparse, the shared expert's width required
    let c = qwen3_config(
        json!({"model_type": "qwen3_5_moe_text", "norm_topk_prob": false,
        "decoder_sparse_step": 3, "shared_expert_intermediate_size": 24}),
    );
    let s = MoeSettings::from_text_config(MoeFamily::Qwen3_5Moe, &c, 4).expect("valid");
    assert!(s.norm_topk_prob && (0..4).all(|l| s.is_sparse(l)));
    assert_eq!(s.shape(32).shared_intermediate, Some(24));
}

#[test]
fn configs_that_cannot_be_served_are_refused_by_field() {
    let q3 = MoeFamily::Qwen3Moe;
    let cases = [
        (
            json!({"num_experts_per_tok": 9}),
            "num_experts_per_tok = 9 exceeds num_experts = 8",
        ),
        (
            json!({"num_experts_per_tok": 0}),
            "num_experts_per_tok = 0 must be positive",
        ),
        (
            json!({"decoder_sparse_step": 0}),
            "decoder_sparse_step = 0 must be positive",
        ),
        (
            json!({"moe_intermediate_size": -1}),
            "moe_intermediate_size = -1 must be positive",
        ),
        (
            json!({"mlp_only_layers": [1, 7]}),
            "mlp_only_layers names layer 7",
        ),
        (
            json!({"mlp_only_layers": "all"}),
            "mlp_only_layers = \"all\" is not a list",
        ),
        (
            json!({"norm_topk_prob": "yes"}),
            "norm_topk_prob = \"yes\" is not true or false",
        ),
        (
            json!({"hidden_act": "gelu"}),
            "hidden_act = \"gelu\" is not supported",
        ),
        (
            json!({"num_experts_per_tok": 2.5}),
            "num_experts_per_tok = 2.5 is not an integer",
        ),
    ];
    for (extra, want) in cases {
        let got = refusal(qwen3_config(extra.clone()), q3);
        assert!(got.contains(want), "{extra}: {got}");
    }
    let mut c = qwen3_config(json!({}));
    c.remove("num_local_experts");
    assert!(refusal(c, q3).contains("field num_experts is missing"));
    let got = refusal(qwen3_config(json!({})), MoeFamily::Qwen3_5Moe);
    assert!(
        got.contains("shared_expert_intermediate_size is missing"),
        "{got}"
    );
    let c = qwen3_config(json!({"shared_expert_intermediate_size": 0}));
    let got = refusal(c, MoeFamily::Qwen3_5Moe);
    assert!(
        got.contains("shared_expert_intermediate_size = 0 must be positive"),
        "{got}"
    );
}

#[test]
fn a_block_without_experts_in_the_weights_is_refused_by_name() {
    let load = |_: &str, _: &[i64]| -> Result<Tensor> { bail!("unused") };
    let contains = |_: &str| false;
    let source = TensorSource {
        load: &load,
        contains: &contains,
    };
    let err = ExpertLayout::detect("model.layers.2.mlp", &source).expect_err("no experts");
    let msg = err.to_string();
    assert!(
        msg.contains("model.layers.2.mlp.experts.gate_up_proj"),
        "{msg}"
    );
    assert!(
        msg.contains("model.layers.2.mlp.experts.0.gate_proj.weight"),
        "{msg}"
    );
    assert_eq!(MoeFamily::of_model_type("qwen3"), None);
    assert_eq!(
        MoeFamily::of_model_type("qwen3_5_moe"),
        Some(MoeFamily::Qwen3_5Moe)
    );
}

/// A fixture's sparse layers with what the GPU tests load them with: (folder, settings, hidden
/// size, the transformers references, the sparse layers' indices).
type SparseFixture = (PathBuf, MoeSettings, i64, HashMap<String, Tensor>, Vec<i64>);

fn sparse_fixture(name: &str) -> SparseFixture {
    let dir = fixtures().join(name);
    let (family, c, layers) = text_config(&dir);
    let settings = MoeSettings::from_text_config(family, &c, layers).expect("settings");
    let hidden = c["hidden_size"].as_i64().expect("hidden_size");
    let refs = read(&dir.join("blocks.safetensors"));
    let sparse = (0..layers).filter(|&l| settings.is_sparse(l)).collect();
    (dir, settings, hidden, refs, sparse)
}

/// The CUDA graph library and the first GPU, for the GPU tests.
fn cuda() -> (crate::aten_ext::graph::GraphLibrary, Device) {
    let runtime = crate::runtime::TorchRuntime::init();
    assert!(runtime.cuda_devices() >= 1, "this test needs a CUDA device");
    let library = runtime.graphs.clone().expect("the CUDA graph library");
    (library, Device::Cuda(0))
}

/// On a GPU: the bf16 block runs inside a CUDA graph (a host read would fail the capture) and
/// its replay equals the eager run; the grouped kernel agrees with one product per expert
/// within bf16 rounding; float32 blocks (libtorch's grouped fallback) match transformers within
/// 1e-4 on every token whose choice no tie decides (the references come from transformers on
/// the CPU; CUDA's topk orders equal probabilities its own way, as transformers' does on CUDA);
/// the tied tokens equal the per-expert products of CUDA's own choice.
/// `cargo test --release --lib -- --ignored moe` on an sm90 / sm100 GPU.
#[test]
#[ignore = "needs a CUDA device (sm90 or sm100 for the grouped bf16 kernel)"]
fn cuda_blocks_run_without_host_reads_and_match_transformers() {
    use crate::aten_ext::graph::CudaGraph;
    let (library, device) = cuda();
    for name in ["qwen3_moe_norm", "qwen3_moe_step2", "qwen3_5_moe"] {
        let (dir, settings, hidden, refs, sparse) = sparse_fixture(name);
        for l in sparse {
            let r = |k: &str| refs[&format!("l{l}.{k}")].to_device(device);
            let f32_block = load_block(&dir, &settings, hidden, l, (Kind::Float, device));
            let out = f32_block.forward(&r("x"));
            let x = refs[&format!("l{l}.x")].reshape([-1, hidden]);
            let cpu_block = load_block(&dir, &settings, hidden, l, (Kind::Float, Device::Cpu));
            let untied = tied_rows(&cpu_block, &x)
                .logical_not()
                .nonzero()
                .squeeze_dim(1);
            assert!(untied.size()[0] > 0, "{name} layer {l}: every token tied");
            let want = refs[&format!("l{l}.out")].reshape([-1, hidden]);
            let got = out.reshape([-1, hidden]).to_device(Device::Cpu);
            let diff = max_diff(
                &got.index_select(0, &untied),
                &want.index_select(0, &untied),
            );
            assert!(diff < 1e-4, "{name} layer {l} float32 on CUDA: {diff}");
            let own = f32_block.forward_with(&r("x"), ExpertGemm::PerExpert);
            let diff = max_diff(&out, &own);
            assert!(
                diff < 1e-4,
                "{name} layer {l} float32 grouped vs per expert: {diff}"
            );
            let block = load_block(&dir, &settings, hidden, l, (Kind::BFloat16, device));
            let x = r("x_bf16");
            let eager = block.forward(&x);
            let per_expert = block.forward_with(&x, ExpertGemm::PerExpert);
            let diff = max_diff(&eager, &per_expert);
            assert!(
                diff < 0.05,
                "{name} layer {l}: grouped vs per expert {diff}"
            );
            let (graph, out) = CudaGraph::capture(library, device, 2, || block.forward(&x))
                .unwrap_or_else(|e| panic!("{name} layer {l}: capture: {e:#}"));
            graph.replay().expect("replay");
            tch::Cuda::synchronize(0);
            assert_eq!(
                out, eager,
                "{name} layer {l}: the replay equals the eager run"
            );
        }
    }
}

/// `moe_route`'s weights against `SparseMoe::routing`'s libtorch operations on a GPU (topk,
/// a float32 sum, a division and a cast), bit for bit, normalised or not, for each kind.
fn route_weights_equal_libtorchs(kernels: &FusedKernels, probs: &Tensor, k: i64, what: &str) {
    let (top, want_i) = probs.topk(k, -1, true, true);
    for (normalize, kind) in [
        (true, Kind::BFloat16),
        (true, Kind::Half),
        (true, Kind::Float),
        (false, Kind::BFloat16),
    ] {
        let want = if normalize {
            &top / top.sum_dim_intlist(-1, true, Kind::Float)
        } else {
            top.shallow_clone()
        }
        .to_kind(kind);
        let (got, got_i) = kernels
            .moe_route(probs, k, normalize, kind)
            .expect("moe_route");
        let off = got
            .to_kind(Kind::Float)
            .ne_tensor(&want.to_kind(Kind::Float))
            .sum(Kind::Int64)
            .int64_value(&[]);
        assert!(got_i.equal(&want_i), "{what}: moe_route's experts");
        assert_eq!(
            off, 0,
            "{what}, normalise {normalize}, {kind:?}: weights off libtorch's"
        );
    }
}

/// On a GPU, the fused routing against libtorch's: `moe_topk` returns what `topk` does (values
/// bit for bit, the same experts in the same order) on softmaxes of logits drawn from a few
/// levels (so that most tokens have equal probabilities among and around their top k), for
/// 256, 128, 6 and 1000 experts; `moe_groups` what the stable sort of the pairs, the binary
/// search and the inverse permutation give; and the whole fused block (`add_forward_fused`,
/// bf16, in a CUDA graph: no host reads) what libtorch's operations add to the residual.
/// `cargo test --release --lib -- --ignored moe` on an sm90 / sm100 GPU.
#[test]
#[ignore = "needs a CUDA device (sm90 or sm100 for the grouped bf16 kernel)"]
fn cuda_fused_routing_equals_libtorchs() {
    use crate::aten_ext::graph::CudaGraph;
    let (library, device) = cuda();
    let kernels = crate::runtime::fused_kernels_or_warn(device).expect("the fused kernels");
    tch::manual_seed(7);
    for (tokens, experts, k, levels) in [
        (3072, 256, 8, 12),
        (3001, 128, 8, 40),
        (77, 6, 2, 2),
        (500, 1000, 10, 16),
    ] {
        let levels_of = Tensor::randint(levels, [tokens, experts], (Kind::Int64, device));
        let logits = (levels_of.to_kind(Kind::Float) * 0.25).to_kind(Kind::BFloat16);
        let probs = logits.softmax(-1, Kind::Float);
        let (want_v, want_i) = probs.topk(k, -1, true, true);
        let (got_v, got_i) = kernels.moe_topk(&probs, k).expect("moe_topk");
        let what = format!("{tokens} tokens, top {k} of {experts}");
        assert!(got_i.equal(&want_i), "{what}: experts differ from topk's");
        assert!(got_v.equal(&want_v), "{what}: values differ from topk's");
        // the ties the comparison covered: tokens with equal values among their choices
        let tied = want_v
            .narrow(1, 1, k - 1)
            .eq_tensor(&want_v.narrow(1, 0, k - 1))
            .any_dim(1, false)
            .sum(Kind::Int64)
            .int64_value(&[]);
        assert!(tied > 0, "{what}: no ties");
        route_weights_equal_libtorchs(&kernels, &probs, k, &what);
        // grouping the chosen pairs
        let groups = kernels.moe_groups(&want_i, experts).expect("moe_groups");
        let ids = want_i.reshape([-1]).to_kind(Kind::Int);
        let (sorted, order) = ids.sort_stable(true, 0, false);
        let ends = group_ends(&sorted, experts);
        assert!(groups.ends.equal(&ends), "{what}: group ends");
        let pairs = tokens * k;
        let mut inverse = order.empty_like();
        let _ = inverse.index_copy_(0, &order, &Tensor::arange(pairs, (Kind::Int64, device)));
        assert!(groups.positions.equal(&inverse), "{what}: positions");
        assert!(
            groups.row_tokens.equal(&order.floor_divide_scalar(k)),
            "{what}: row tokens"
        );
    }
    // routing weights of probabilities without ties, where the order of the sum shows
    let logits = Tensor::randn([3072, 256], (Kind::Float, device)) * 3.0;
    route_weights_equal_libtorchs(&kernels, &logits.softmax(-1, Kind::Float), 8, "randn 256");
    let logits = Tensor::randn([999, 1000], (Kind::Float, device)) * 3.0;
    route_weights_equal_libtorchs(&kernels, &logits.softmax(-1, Kind::Float), 13, "randn 1000");
    // the fused block against libtorch's operations, and inside a CUDA graph
    for name in ["qwen3_moe_norm", "qwen3_5_moe"] {
        let (dir, settings, hidden, refs, sparse) = sparse_fixture(name);
        for l in sparse {
            let block = load_block(&dir, &settings, hidden, l, (Kind::BFloat16, device));
            let x = refs[&format!("l{l}.x_bf16")].to_device(device);
            let residual = x.flip([-1]).contiguous();
            let mut want = residual.copy();
            block.add_forward(&mut want, &x);
            let mut got = residual.copy();
            block
                .add_forward_fused(&mut got, &x, &kernels)
                .unwrap_or_else(|e| panic!("{name} layer {l}: {e:#}"));
            // one rounding of float32 sums taken in another order may differ by one bf16 step
            let diff = max_diff(&got, &want);
            let same = got
                .eq_tensor(&want)
                .to_kind(Kind::Double)
                .mean(Kind::Double);
            let same = same.double_value(&[]);
            assert!(
                diff < 0.02 && same > 0.999,
                "{name} layer {l}: fused vs libtorch {diff}, {same} equal"
            );
            let (graph, out) = CudaGraph::capture(library, device, 2, || {
                let mut r = residual.copy();
                block.add_forward_fused(&mut r, &x, &kernels).map(|()| r)
            })
            .unwrap_or_else(|e| panic!("{name} layer {l}: capture: {e:#}"));
            graph.replay().expect("replay");
            tch::Cuda::synchronize(0);
            let out = out.unwrap_or_else(|e| panic!("{name} layer {l}: in the graph: {e:#}"));
            assert!(
                out.equal(&got),
                "{name} layer {l}: the replay equals the eager run"
            );
        }
    }
}
