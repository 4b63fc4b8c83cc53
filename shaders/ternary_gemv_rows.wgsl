// RMSNorm + int8 quantization + ternary GEMV for a few token rows (N_TOK = 2..SMALL_T_MAX, e.g. the
// k+1 rows of a speculative verify step), where the tiled prefill GEMM would cost as much as for a
// full token tile. A workgroup takes TOK of the rows and keeps its weight words in registers for
// them; the TB = ceil(N_TOK / TOK) workgroups that share the same weight rows are adjacent in the
// dispatch (workgroup g * TB + b), so they run together and the weights come from memory once (the
// others' reads hit L2). TOK trades parallelism (rows in different workgroups run concurrently)
// against the registers and the serial per-row work of one workgroup.
//
// Per token row t (the math of ternary_gemv_norm.wgsl, row by row):
//   h = x[t] * norm_w;  r_t = 1 / sqrt(mean(x[t]^2) + EPS)  (NORMALIZE; else 1)
//   s_t = 127 / max(r_t * max|h|, 1e-5);  hq = clamp(round(h * (r_t * s_t)), -128, 127)
//   y[t, n] = wscale[n] / s_t * sum_k (code[n, k] - 1) * hq[k]   then the epilogue (_epilogue)
//
// Mapping: GROUPS row groups of GW >= K/64 threads, each group owning ROWS weight rows (TOTAL =
// GROUPS * ROWS accumulators per token row); thread (group gi, chunk c) loads the 16-byte chunk c of
// its ROWS weight rows first and keeps it in registers for all TOK token rows. Then:
//   1. statistics: for every row t, the thread's share (64 / GROUPS values of chunk c) of sum(x^2)
//      and max|h|; TOK reduction rounds of _norm_reduce give every thread r_t and s_t;
//   2. per row t: the thread quantizes the 64 inputs of chunk c (re-read from cache) into four
//      vec4 of int8 words, takes ROWS dot products with its weight registers and adds them, per
//      subgroup, into the workgroup's integer accumulators of row t (exact: results do not depend
//      on the order);
//   3. one barrier, then the epilogue for TOK * OUTS outputs.
// Rows past N_TOK (the last block) are computed on row N_TOK - 1 and not stored.
// Per-thread values are unrolled `let`s (//#for, see common.unroll_loops), never indexed arrays.
//
// Weight layout (x86 I2_S, see ternary_gemv_norm.wgsl): chunk c holds the codes of input vec4
// 32(c/2) + 4(c%2) + 8s + j (s, j < 4) in word j shifted by 6 - 2s.
//
// Bindings: as ternary_gemv_norm.wgsl (weights, wscale, x [N_TOK, K/4] vec4<f32>, norm_w with
// HAS_WEIGHT, out [N_TOK, OUT_W] f32). Dispatch: (ceil(OUT_W / OUTS) * TB, 1, 1), OUTS = TOTAL (TOTAL/2 gated).

const K: u32 = ${K};
const N: u32 = ${N};
const ROWS: u32 = ${ROWS};  // weight rows per row group
const GROUPS: u32 = ${GROUPS};
const GW: u32 = ${GW};  // threads per row group, >= K/64
const N_TOK: u32 = ${N_TOK};  // token rows of the step
const TOK: u32 = ${TOK};  // token rows per workgroup
const SVEC: u32 = ${SVEC};  // runs of 4 input vec4 whose statistics a thread takes: 4 / GROUPS
const EPILOGUE: u32 = ${EPILOGUE};
const EPS: f32 = ${EPS};
const K_F: f32 = ${K_F};

const CHUNKS: u32 = K / 64u;
const X4: u32 = K / 4u;
const TB: u32 = (N_TOK + TOK - 1u) / TOK;
const WG: u32 = GROUPS * GW;
const TOTAL: u32 = GROUPS * ROWS;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUTS: u32 = select(TOTAL, TOTAL / 2u, GATED);
const OUT_W: u32 = select(N, HALF, GATED);

@group(0) @binding(0) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wscale: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
//#if HAS_WEIGHT
@group(0) @binding(3) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
//#else
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#endif

var<workgroup> acc_rows: array<atomic<i32>, TOTAL * TOK>;  // accumulator r of local row t at t * TOTAL + r
var<workgroup> lanes_fit_wg: u32;  // 1 when subgroups never straddle two row groups

//#include _ternary_codes
//#include _epilogue
//#include _norm_reduce

// Input vec4 `at` of token row t, times the norm weight.
fn scaled_input(t: u32, at: u32) -> vec4<f32> {
//#if HAS_WEIGHT
    return x[t * X4 + at] * norm_w[at];
//#else
    return x[t * X4 + at];
//#endif
}

fn int8_word(v: vec4<f32>, k: f32) -> u32 {
    let q = bitcast<vec4<u32>>(vec4<i32>(clamp(round(v * k), vec4<f32>(-128.0), vec4<f32>(127.0))));
    return (q.x & 0xffu) | ((q.y & 0xffu) << 8u) | ((q.z & 0xffu) << 16u) | ((q.w & 0xffu) << 24u);
}

// Four consecutive input vec4 (at, at+1, at+2, at+3) of row t as int8 words at scale k.
fn quantized_run(t: u32, at: u32, k: f32) -> vec4<u32> {
    return vec4<u32>(int8_word(scaled_input(t, at), k), int8_word(scaled_input(t, at + 1u), k),
                     int8_word(scaled_input(t, at + 2u), k), int8_word(scaled_input(t, at + 3u), k));
}

// Add a thread's integer partial to accumulator `slot` (subgroup-reduced first when that is exact).
fn accumulate(slot: u32, a: i32, fits: bool, lane: u32) {
//#if SUBGROUPS
    if (fits) {
        let total = subgroupAdd(a);
        if (lane == 0u) {
            atomicAdd(&acc_rows[slot], total);
        }
        return;
    }
//#endif
    atomicAdd(&acc_rows[slot], a);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let g = wid.x / TB;
    let t0 = (wid.x % TB) * TOK;
    let gi = lid / GW;
    let live = lid % GW < CHUNKS;
    let c = min(lid % GW, CHUNKS - 1u);  // idle threads read a valid chunk and contribute nothing
//#for r in ROWS
    let w{{r}} = weights[min(group_row(g, gi * ROWS + {{r}}u, TOTAL), N - 1u) * CHUNKS + c];
//#endfor
    for (var i = lid; i < TOTAL * TOK; i += WG) {  // explicit zeroing (see ternary_gemv.wgsl)
        atomicStore(&acc_rows[i], 0i);
    }
    let base = (c / 2u) * 32u + (c % 2u) * 4u;  // chunk c's first input vec4
    let mine = base + gi * SVEC * 8u;  // the runs whose statistics this thread takes

    // 1. Statistics of every row, then one reduction round per row (a barrier between rounds:
    //    the rounds share their slots).
//#if SUBGROUPS
    if (lid == 0u) {
        lanes_fit_wg = select(0u, 1u, GW % sg_size == 0u);
    }
    let lane = sg_lane;
//#else
    let lane = 0u;
//#endif
//#for t in TOK
    let row{{t}} = min(t0 + {{t}}u, N_TOK - 1u);
    var ss{{t}} = 0.0;
    var mx{{t}} = 0.0;
//#for q in SVEC
//#for j in 4
    {
        let v = x[row{{t}} * X4 + mine + {{q}}u * 8u + {{j}}u];
        let h = scaled_input(row{{t}}, mine + {{q}}u * 8u + {{j}}u);
        ss{{t}} += dot(v, v);
        let a = abs(h);
        mx{{t}} = max(mx{{t}}, max(max(a.x, a.y), max(a.z, a.w)));
    }
//#endfor
//#endfor
//#endfor
//#for t in TOK
//#if SUBGROUPS
    let red{{t}} = reduce_sum_max(select(0.0, ss{{t}}, live), select(0.0, mx{{t}}, live), lid, sg_size, sg_lane);
//#else
    let red{{t}} = reduce_sum_max(select(0.0, ss{{t}}, live), select(0.0, mx{{t}}, live), lid);
//#endif
    workgroupBarrier();
//#if NORMALIZE
    let rn{{t}} = 1.0 / sqrt(red{{t}}.x / K_F + EPS);
//#else
    let rn{{t}} = 1.0;
//#endif
    let s{{t}} = 127.0 / max(red{{t}}.y * rn{{t}}, 1e-5);
//#endfor
    let fits = workgroupUniformLoad(&lanes_fit_wg) == 1u;

    // 2. Per row: quantize chunk c, dot it with the ROWS weight chunks, accumulate.
//#for t in TOK
    {
        let k = rn{{t}} * s{{t}};
        let q0 = quantized_run(row{{t}}, base, k);
        let q1 = quantized_run(row{{t}}, base + 8u, k);
        let q2 = quantized_run(row{{t}}, base + 16u, k);
        let q3 = quantized_run(row{{t}}, base + 24u, k);
        let qsum = word_sum(q0) + word_sum(q1) + word_sum(q2) + word_sum(q3);
//#for r in ROWS
        accumulate({{t}}u * TOTAL + gi * ROWS + {{r}}u, select(0i, block_dot(w{{r}}, q0, q1, q2, q3) - qsum, live),
                   fits, lane);
//#endfor
    }
//#endfor

    // 3. Epilogue: thread lid < OUTS writes output o of every row.
    workgroupBarrier();
    let o = g * OUTS + lid;
    if (lid < OUTS && o < OUT_W) {
//#for t in TOK
        if (t0 + {{t}}u < N_TOK) {
            let inv_s = 1.0 / s{{t}};
            let y = wscale[group_row(g, lid, TOTAL)] * inv_s * f32(atomicLoad(&acc_rows[{{t}}u * TOTAL + lid]));
            var u = 0.0;
            if (GATED) {
                let up = lid + OUTS;
                u = wscale[group_row(g, up, TOTAL)] * inv_s * f32(atomicLoad(&acc_rows[{{t}}u * TOTAL + up]));
            }
            store_out(row{{t}} * OUT_W + o, y, u);
        }
//#endfor
    }
}
