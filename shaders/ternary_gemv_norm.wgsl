// RMSNorm + int8 quantization of one token row, folded into the ternary GEMV that consumes it
// (decode): no separate rmsnorm_quant dispatch, no x_q round trip through memory.
//
//   h = x[t] * norm_w                                    (norm_w only with HAS_WEIGHT)
//   r = 1 / sqrt(mean(x[t]^2) + EPS)                     (NORMALIZE; else r = 1)
//   s = 127 / max(r * max|h|, 1e-5);  hq = clamp(round(h * (r * s)), -128, 127)
//   y[n] = wscale[n] / s * sum_k (code[n, k] - 1) * hq[k]   then the epilogue of ternary_gemv.wgsl
//
// This is rmsnorm_quant.wgsl's function (x * r * w, quantized) with the products associated as
// (x * w) * (r * s): the same codes except within float32 rounding of a .5 tie.
//
// Every workgroup recomputes the norm of the (small, cache-resident) input row, so the row's
// f32 values and norm weights are read from L2 once per workgroup: the workgroup is GROUPS row
// groups of GW >= K/64 threads, each group owning ROWS weight rows, and thread (group gi, chunk c)
// owns 16-byte chunk c of its group's rows. It loads and normalizes 64/GROUPS of the 64 inputs of
// chunk c (one combined reduction round gives sum of squares and absmax), then:
//   GROUPS == 1: quantizes all 64 inputs of its chunk in registers (no workgroup memory, no barrier);
//   GROUPS > 1 (SHARED_ROW): writes its quantized words to workgroup memory, and after one barrier
//                every thread reads the 16 words of its chunk.
// Its ROWS weight loads are issued first, so their latency overlaps the norm.
//
// Weight layout (x86 I2_S, see ternary_gemv.wgsl): chunk c = half h = c % 2 of block b = c / 2;
// u32 word j of it, shifted by 6 - 2s and masked, holds the codes of values
// 128b + 32s + 16h + 4j + (0..3), i.e. input vec4 32b + 8s + 4h + j (word p = 4s + j of the chunk).
//
// Bindings:
//   0 weights  [N, K/64] vec4<u32>   2-bit codes (x86 I2_S rows)
//   1 wscale   [N] f32
//   2 x        [T, K/4] vec4<f32>    un-normalized input rows
//   3 norm_w   [K/4] vec4<f32>       RMSNorm weight (only with HAS_WEIGHT; `out` then moves to 3)
//   4 out      [T, OUT_W] f32
//   5 params   uniform StepParams    only with BOUNDED (verify steps; 4 without HAS_WEIGHT): token rows
//                                    from n_tokens on exit at once (a draft shorter than the step's rows)
//
// QUANT_ONLY: the norm and quantization alone, for the rows of a verify step (one workgroup row per
// token, no weights): each thread writes its quantized words to xq_out [T, K/16] vec4<u32> in the
// order ternary_gemv.wgsl reads (vec4 8b + 2s + h holds values 128b + 32s + 16h + 0..15) and thread 0
// writes 1/s to xscale_out [T] f32; ternary_gemv.wgsl then computes per row what this kernel would
// (the same words, wscale * (1/s) * the exact integer sum, the same epilogue), so a verify row still
// equals its decode step bit for bit. Bindings: 0 x, 1 norm_w (HAS_WEIGHT), then xq_out, xscale_out
// and params (BOUNDED). Dispatch: (1, n_tokens, 1).
//
// Per-thread values are unrolled `let`s (//#for, see common.unroll_loops), never loop-indexed arrays.
// Mapping: accumulators TOTAL = GROUPS * ROWS per workgroup (TOTAL output rows, or TOTAL/2 gate rows
// and the matching up rows) for token t = workgroup_id.y; group gi owns accumulators gi*ROWS + r.
// Dispatch: (ceil(OUT_W / OUTS), n_tokens, 1) with OUTS = TOTAL (or TOTAL/2 gated).

${STEP_PARAMS}
const K: u32 = ${K};
const N: u32 = ${N};
const ROWS: u32 = ${ROWS};  // weight rows per row group
const GROUPS: u32 = ${GROUPS};
const GW: u32 = ${GW};  // threads per row group, >= K/64
const SVEC: u32 = ${SVEC};  // runs of 4 input vec4 per thread: 4 / GROUPS
const WG: u32 = GROUPS * GW;
const TOTAL: u32 = GROUPS * ROWS;
const EPILOGUE: u32 = ${EPILOGUE};
const EPS: f32 = ${EPS};
const K_F: f32 = ${K_F};

const CHUNKS: u32 = K / 64u;
const X4: u32 = K / 4u;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUTS: u32 = select(TOTAL, TOTAL / 2u, GATED);
const OUT_W: u32 = select(N, HALF, GATED);

//#if QUANT_ONLY
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
//#if HAS_WEIGHT
@group(0) @binding(1) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> xq_out: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> xscale_out: array<f32>;
//#if BOUNDED
@group(0) @binding(4) var<uniform> params: StepParams;
//#endif
//#else
@group(0) @binding(1) var<storage, read_write> xq_out: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> xscale_out: array<f32>;
//#if BOUNDED
@group(0) @binding(3) var<uniform> params: StepParams;
//#endif
//#endif
//#else
@group(0) @binding(0) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wscale: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
//#if HAS_WEIGHT
@group(0) @binding(3) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
//#if BOUNDED
@group(0) @binding(5) var<uniform> params: StepParams;
//#endif
//#else
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#if BOUNDED
@group(0) @binding(4) var<uniform> params: StepParams;
//#endif
//#endif
//#endif

var<workgroup> sg_fits_wg: u32;  // 1 when subgroups never straddle two row groups
//#if !QUANT_ONLY
var<workgroup> acc_wg: array<atomic<i32>, TOTAL>;
//#if SHARED_ROW
var<workgroup> xq_s: array<vec4<u32>, CHUNKS * 4u>;  // chunk c's quantized inputs: vec4 4c + s
//#endif

//#include _ternary_codes
//#include _epilogue

// Weight row of accumulator r (0..TOTAL-1) of workgroup g.
fn weight_row(g: u32, r: u32) -> u32 {
    return group_row(g, r, TOTAL);
}
//#else
//#include _int8
//#endif
//#include _norm_reduce


// v * k rounded to int8 (pack_i8 of _int8).
fn quantize_i8(v: vec4<f32>, k: f32) -> u32 {
    return pack_i8(clamp(round(v * k), vec4<f32>(-128.0), vec4<f32>(127.0)));
}

fn max4(a: vec4<f32>) -> f32 {
    return max(max(a.x, a.y), max(a.z, a.w));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let g = wid.x;
    let t = wid.y;
//#if BOUNDED
    if (t >= params.n_tokens) {  // uniform: the whole workgroup leaves
        return;
    }
//#endif
    let gi = lid / GW;
    let cl = lid % GW;
    let live = cl < CHUNKS;
    let c = min(cl, CHUNKS - 1u);  // idle threads load a valid chunk and contribute nothing
//#if !QUANT_ONLY

    // Weight loads first (clamped indices, no branch): nothing needs them until the dot products.
//#for r in ROWS
    let w{{r}} = weights[min(weight_row(g, gi * ROWS + {{r}}u), N - 1u) * CHUNKS + c];
//#endfor
    if (lid < TOTAL) {  // explicit zeroing (lavapipe was seen to keep old workgroup values); WG >= TOTAL
        atomicStore(&acc_wg[lid], 0i);
    }
    // The epilogue's own loads (row scales, the residual) issued now too: at the end they would add
    // one memory latency after the last barrier. Only this thread writes out[o], at the end.
    let o = g * OUTS + lid;
    let stores = lid < OUTS && o < OUT_W;
    var scale_y = 0.0;
    var scale_u = 0.0;
    var residual = 0.0;
    if (stores) {
        scale_y = wscale[weight_row(g, lid)];
        if (GATED) {
            scale_u = wscale[weight_row(g, lid + OUTS)];
        }
        if (EPILOGUE == 1u) {
            residual = out[t * OUT_W + o];
        }
    }
//#endif

    // This thread's inputs: runs s = gi * SVEC + q (q < SVEC) of chunk c, at vec4 32b + 8s + 4h + j.
    let at = (c / 2u) * 32u + (c % 2u) * 4u + gi * SVEC * 8u;
    let xrow = t * X4 + at;
    var ss = 0.0;
    var mx = 0.0;
//#for q in SVEC
//#for j in 4
    let v{{q}}_{{j}} = x[xrow + {{q}}u * 8u + {{j}}u];
//#if HAS_WEIGHT
    let h{{q}}_{{j}} = v{{q}}_{{j}} * norm_w[at + {{q}}u * 8u + {{j}}u];
//#else
    let h{{q}}_{{j}} = v{{q}}_{{j}};
//#endif
    ss += dot(v{{q}}_{{j}}, v{{q}}_{{j}});
    mx = max(mx, max4(abs(h{{q}}_{{j}})));
//#endfor
//#endfor
    if (!live) {
        ss = 0.0;
        mx = 0.0;
    }

    // One reduction round for both: subgroup sums/maxima into one slot per subgroup, or a tree.
//#if SUBGROUPS
    if (lid == 0u) {
        sg_fits_wg = select(0u, 1u, GW % sg_size == 0u);
    }
    let red = reduce_sum_max(ss, mx, lid, sg_size, sg_lane);  // its barrier also publishes sg_fits_wg
    let sg_fits = workgroupUniformLoad(&sg_fits_wg) == 1u;
//#else
    let red = reduce_sum_max(ss, mx, lid);
//#endif
    let total = red.x;
    let amax = red.y;
//#if NORMALIZE
    let rn = 1.0 / sqrt(total / K_F + EPS);
//#else
    let rn = 1.0;
//#endif
    let s = 127.0 / max(amax * rn, 1e-5);
    let k = rn * s;
//#if QUANT_ONLY
    if (live) {
//#for q in SVEC
        xq_out[t * (K / 16u) + (c / 2u) * 8u + 2u * (gi * SVEC + {{q}}u) + c % 2u] = vec4<u32>(
            quantize_i8(h{{q}}_0, k), quantize_i8(h{{q}}_1, k), quantize_i8(h{{q}}_2, k), quantize_i8(h{{q}}_3, k));
//#endfor
    }
    if (lid == 0u) {
        xscale_out[t] = 1.0 / s;
    }
//#else
//#if SHARED_ROW
    if (live) {
//#for q in SVEC
        xq_s[c * 4u + gi * SVEC + {{q}}u] = vec4<u32>(quantize_i8(h{{q}}_0, k), quantize_i8(h{{q}}_1, k),
                                                      quantize_i8(h{{q}}_2, k), quantize_i8(h{{q}}_3, k));
//#endfor
    }
    workgroupBarrier();
    let x0 = xq_s[c * 4u];
    let x1 = xq_s[c * 4u + 1u];
    let x2 = xq_s[c * 4u + 2u];
    let x3 = xq_s[c * 4u + 3u];
//#else
//#for q in 4
    let x{{q}} = vec4<u32>(quantize_i8(h{{q}}_0, k), quantize_i8(h{{q}}_1, k), quantize_i8(h{{q}}_2, k),
                           quantize_i8(h{{q}}_3, k));
//#endfor
//#endif
    let xsum = word_sum(x0) + word_sum(x1) + word_sum(x2) + word_sum(x3);

//#for r in ROWS
    let a{{r}} = select(0i, block_dot(w{{r}}, x0, x1, x2, x3) - xsum, live);
//#endfor
//#if SUBGROUPS
    if (sg_fits) {
//#for r in ROWS
        let sum{{r}} = subgroupAdd(a{{r}});
//#endfor
        if (sg_lane == 0u) {
//#for r in ROWS
            atomicAdd(&acc_wg[gi * ROWS + {{r}}u], sum{{r}});
//#endfor
        }
    } else {  // a subgroup wider than a row group: one atomic per thread
//#for r in ROWS
        atomicAdd(&acc_wg[gi * ROWS + {{r}}u], a{{r}});
//#endfor
    }
//#else
//#for r in ROWS
    atomicAdd(&acc_wg[gi * ROWS + {{r}}u], a{{r}});
//#endfor
//#endif
    workgroupBarrier();
    if (stores) {
        let inv_s = 1.0 / s;
        let y = scale_y * inv_s * f32(atomicLoad(&acc_wg[lid]));
        var u = 0.0;
        if (GATED) {
            u = scale_u * inv_s * f32(atomicLoad(&acc_wg[lid + OUTS]));
        }
        store_out_from(t * OUT_W + o, y, u, residual);
    }
//#endif
}
