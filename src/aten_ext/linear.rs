//! The projections of a layer that read the same activations (queries, keys and values;
//! SwiGLU's gate and up) as one autograd node (autograd.cpp's `SharedInputLinear`): the same
//! products forward, and a backward pass that sums the input's gradient inside the products
//! (`addmm_` with beta 1) instead of writing each product's gradient and adding them in
//! separate passes over the activations, as autograd does for an input read several times.

use std::ffi::c_void;

use anyhow::{anyhow, ensure, Result};
use tch::Tensor;

use super::{check, ffi};

/// `x W_i^T` for each weight `W_i` [out_i, in] of `x` [..., in], no biases: the results of
/// `x.linear(W_i, None)`, differentiable in `x` and every weight.
pub fn shared_input_linear(x: &Tensor, weights: &[&Tensor]) -> Result<Vec<Tensor>> {
    ensure!(!weights.is_empty(), "shared_input_linear: no weight");
    let ptrs: Vec<*const c_void> = weights.iter().map(|w| w.as_ptr().cast()).collect();
    let mut out: Vec<*mut c_void> = vec![std::ptr::null_mut(); weights.len()];
    // SAFETY: live tensors; the shim writes one new tensor into each slot of `out` on success
    // only, and each is taken over by a `Tensor` once.
    unsafe {
        check(ffi::dflash_shared_input_linear(
            x.as_ptr().cast(),
            ptrs.as_ptr(),
            ptrs.len(),
            out.as_mut_ptr(),
        ))?;
        if out.iter().any(|p| p.is_null()) {
            return Err(anyhow!("shared_input_linear returned no tensor"));
        }
        Ok(out
            .into_iter()
            .map(|p| Tensor::from_ptr(p.cast()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The node's products are `linear`'s, and the gradients of the input and of every weight
    /// are what autograd takes through separate `linear`s (float64), also where only some of
    /// the outputs have a gradient and where the input needs none.
    #[test]
    fn the_node_equals_separate_products_in_values_and_gradients() {
        tch::manual_seed(3);
        let opts = (Kind::Double, Device::Cpu);
        let x = Tensor::randn([2, 5, 8], opts).set_requires_grad(true);
        let ws: Vec<Tensor> = [8, 4, 6]
            .iter()
            .map(|&o| Tensor::randn([o, 8], opts).set_requires_grad(true))
            .collect();
        let wr: Vec<&Tensor> = ws.iter().collect();
        let got = shared_input_linear(&x, &wr).unwrap();
        let want: Vec<Tensor> = ws.iter().map(|w| x.linear::<&Tensor>(w, None)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.size(), w.size());
            assert!(g.allclose(w, 0.0, 0.0, false), "values");
        }
        // a loss that weighs the outputs differently (outputs 0 and 2, then all three)
        for used in [vec![0usize, 2], vec![0, 1, 2]] {
            let loss = |ys: &[Tensor]| {
                used.iter()
                    .map(|&i| (&ys[i] * &ys[i] * (i as f64 + 1.0)).sum(Kind::Double))
                    .fold(Tensor::zeros([], opts), |a, b| a + b)
            };
            let mut all: Vec<&Tensor> = vec![&x];
            all.extend(ws.iter());
            let g1 = Tensor::run_backward(&[loss(&got)], &all, true, false);
            let g2 = Tensor::run_backward(&[loss(&want)], &all, true, false);
            for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
                assert_eq!(a.defined(), b.defined(), "gradient {i} of {used:?}");
                if a.defined() {
                    assert!(
                        a.allclose(b, 1e-12, 1e-12, false),
                        "gradient {i} of {used:?}"
                    );
                }
            }
            assert_eq!(
                g1[2].defined(),
                used.contains(&1),
                "an unused output's weight"
            );
        }
        // an input without gradient: the weights' gradients alone
        let xd = x.detach();
        let got = shared_input_linear(&xd, &wr).unwrap();
        let g = Tensor::run_backward(&[got[1].sum(Kind::Double)], &[&ws[1]], false, false);
        let want = Tensor::ones([10, 4], opts).tr().mm(&xd.reshape([10, 8]));
        assert!(g[0].allclose(&want, 1e-12, 1e-12, false));
    }

    #[test]
    fn a_weight_of_another_width_is_refused() {
        let x = Tensor::zeros([3, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::zeros([4, 7], (Kind::Float, Device::Cpu));
        let e = shared_input_linear(&x, &[&w]).unwrap_err().to_string();
        assert!(e.contains("width"), "{e}");
    }
}
