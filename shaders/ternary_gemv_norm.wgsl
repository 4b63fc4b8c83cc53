// RMSNorm + int8 quantization of one token row, folded into the ternary GEMV that consumes it
// (decode only): saves the separate rmsnorm_quant dispatch and its dependency gap.
//
//   h = x[t] / sqrt(mean(x[t]^2) + EPS) * norm_w        (NORMALIZE; norm_w only with HAS_WEIGHT)
//   s = 127 / max(max|h|, 1e-5);  hq = clamp(round(h * s), -128, 127)
//   y[n] = wscale[n] / s * sum_k (code[n, k] - 1) * hq[k]   then the epilogue of ternary_gemv.wgsl
//
// Every workgroup recomputes the norm of the (small, cache-resident) input row into workgroup
// memory; its weight loads are issued first so their latency overlaps that work. Rounding,
// weight layout and epilogues are those of rmsnorm_quant.wgsl and ternary_gemv.wgsl.
//
// Bindings:
//   0 weights  [N, K/64] vec4<u32>   2-bit codes (x86 I2_S rows)
//   1 wscale   [N] f32
//   2 x        [T, K/4] vec4<f32>    un-normalized input rows
//   3 norm_w   [K/4] vec4<f32>       RMSNorm weight (only with HAS_WEIGHT; `out` then moves to 3)
//   4 out      [T, OUT_W] f32
//
// Mapping: WG >= K/64 threads (one 16-byte chunk of each of the ROWS rows per thread) for ROWS
// accumulators of token t = workgroup_id.y; the norm works on 16-value quads lid, lid+WG, ...
// Dispatch: (ceil(OUT_W / OUTS), n_tokens, 1) with OUTS = ROWS (or ROWS/2 gated).

const K: u32 = ${K};
const N: u32 = ${N};
const ROWS: u32 = ${ROWS};
const WG: u32 = ${WG};
const EPILOGUE: u32 = ${EPILOGUE};
const EPS: f32 = ${EPS};
const K_F: f32 = ${K_F};

const CHUNKS: u32 = K / 64u;
const QUADS: u32 = K / 16u;
const QITEMS: u32 = (QUADS + WG - 1u) / WG;
const X4: u32 = K / 4u;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUTS: u32 = select(ROWS, ROWS / 2u, GATED);
const OUT_W: u32 = select(N, HALF, GATED);
const CODE_MASK: u32 = 0x03030303u;
const ONES: u32 = 0x01010101u;

@group(0) @binding(0) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wscale: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
//#if HAS_WEIGHT
@group(0) @binding(3) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
//#else
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#endif

var<workgroup> xq_wg: array<vec4<u32>, QUADS>;
var<workgroup> red: array<f32, WG>;
var<workgroup> acc_wg: array<atomic<i32>, ROWS>;
var<workgroup> n_slots_wg: u32;

//#if DOT4
fn dot4(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}
//#else
fn dot4(a: u32, b: u32) -> i32 {
    let s = bitcast<i32>(b);
    return i32(a & 0xffu) * ((s << 24u) >> 24u) + i32((a >> 8u) & 0xffu) * ((s << 16u) >> 24u)
         + i32((a >> 16u) & 0xffu) * ((s << 8u) >> 24u) + i32(a >> 24u) * (s >> 24u);
}
//#endif

//#if SUBGROUPS
fn reduce_sum(v: f32, lid: u32, sg_size: u32, sg_lane: u32, n_slots: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[lid / sg_size] = s;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < n_slots; i++) {
        total += red[i];
    }
    workgroupBarrier();
    return total;
}

fn reduce_max(v: f32, lid: u32, sg_size: u32, sg_lane: u32, n_slots: u32) -> f32 {
    let s = subgroupMax(v);
    if (sg_lane == 0u) {
        red[lid / sg_size] = s;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < n_slots; i++) {
        total = max(total, red[i]);
    }
    workgroupBarrier();
    return total;
}
//#else
fn reduce_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

fn reduce_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red[lid] = max(red[lid], red[lid + stride]);
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}
//#endif

fn weight_row(g: u32, r: u32) -> u32 {
    if (GATED) {
        let o = g * OUTS + (r % OUTS);
        return select(o, HALF + o, r >= OUTS);
    }
    return g * ROWS + r;
}

fn pack_i8(v: vec4<f32>, s: f32) -> u32 {
    let q = vec4<i32>(clamp(round(v * s), vec4<f32>(-128.0), vec4<f32>(127.0)));
    let b = bitcast<vec4<u32>>(q) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

fn block_dot(w: vec4<u32>, x0: vec4<u32>, x1: vec4<u32>, x2: vec4<u32>, x3: vec4<u32>) -> i32 {
    let c0 = (w >> vec4<u32>(6u)) & vec4<u32>(CODE_MASK);
    let c1 = (w >> vec4<u32>(4u)) & vec4<u32>(CODE_MASK);
    let c2 = (w >> vec4<u32>(2u)) & vec4<u32>(CODE_MASK);
    let c3 = w & vec4<u32>(CODE_MASK);
    return dot4(c0.x, x0.x) + dot4(c0.y, x0.y) + dot4(c0.z, x0.z) + dot4(c0.w, x0.w)
         + dot4(c1.x, x1.x) + dot4(c1.y, x1.y) + dot4(c1.z, x1.z) + dot4(c1.w, x1.w)
         + dot4(c2.x, x2.x) + dot4(c2.y, x2.y) + dot4(c2.z, x2.z) + dot4(c2.w, x2.w)
         + dot4(c3.x, x3.x) + dot4(c3.y, x3.y) + dot4(c3.z, x3.z) + dot4(c3.w, x3.w);
}

fn word_sum(x: vec4<u32>) -> i32 {
    return dot4(ONES, x.x) + dot4(ONES, x.y) + dot4(ONES, x.z) + dot4(ONES, x.w);
}

fn activate(g: f32) -> f32 {
    if (EPILOGUE == 2u) {
        let r = max(g, 0.0);
        return r * r;
    }
    return g / (1.0 + exp(-g));
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
    let c = lid;  // this thread's 16-byte chunk of every row (WG >= CHUNKS)

    // Weight loads first: nothing below depends on them until the dot products.
    var w: array<vec4<u32>, ROWS>;
    if (c < CHUNKS) {
        for (var r = 0u; r < ROWS; r++) {
            w[r] = weights[min(weight_row(g, r), N - 1u) * CHUNKS + c];
        }
    }
    if (lid < ROWS) {  // explicit zeroing (see ternary_gemv.wgsl); WG >= ROWS
        atomicStore(&acc_wg[lid], 0i);
    }
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
//#else
    workgroupBarrier();
//#endif

    // RMSNorm + quantization of row t into xq_wg (quad = 16 values = one vec4<u32>).
    var v: array<vec4<f32>, QITEMS * 4u>;
    var ss = 0.0;
    for (var i = 0u; i < QITEMS; i++) {
        let qd = lid + i * WG;
        for (var e = 0u; e < 4u; e++) {
            if (qd < QUADS) {
                v[i * 4u + e] = x[t * X4 + qd * 4u + e];
            } else {
                v[i * 4u + e] = vec4<f32>(0.0);
            }
            ss += dot(v[i * 4u + e], v[i * 4u + e]);
        }
    }
//#if NORMALIZE
//#if SUBGROUPS
    let total = reduce_sum(ss, lid, sg_size, sg_lane, n_slots);
//#else
    let total = reduce_sum(ss, lid);
//#endif
    let rn = 1.0 / sqrt(total / K_F + EPS);
    for (var i = 0u; i < QITEMS; i++) {
        let qd = min(lid + i * WG, QUADS - 1u);
        for (var e = 0u; e < 4u; e++) {
//#if HAS_WEIGHT
            v[i * 4u + e] = v[i * 4u + e] * rn * norm_w[qd * 4u + e];
//#else
            v[i * 4u + e] = v[i * 4u + e] * rn;
//#endif
        }
    }
//#endif
    var amax = 0.0;
    for (var i = 0u; i < QITEMS * 4u; i++) {
        let a = abs(v[i]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
//#if SUBGROUPS
    amax = reduce_max(amax, lid, sg_size, sg_lane, n_slots);
//#else
    amax = reduce_max(amax, lid);
//#endif
    let s = 127.0 / max(amax, 1e-5);
    for (var i = 0u; i < QITEMS; i++) {
        let qd = lid + i * WG;
        if (qd < QUADS) {
            xq_wg[qd] = vec4<u32>(pack_i8(v[i * 4u], s), pack_i8(v[i * 4u + 1u], s), pack_i8(v[i * 4u + 2u], s),
                                  pack_i8(v[i * 4u + 3u], s));
        }
    }
    workgroupBarrier();

    // The GEMV of ternary_gemv.wgsl on the workgroup's activations.
    var acc: array<i32, ROWS>;
    var xsum = 0i;
    if (c < CHUNKS) {
        let xb = (c / 2u) * 8u + (c % 2u);
        let x0 = xq_wg[xb];
        let x1 = xq_wg[xb + 2u];
        let x2 = xq_wg[xb + 4u];
        let x3 = xq_wg[xb + 6u];
        xsum = word_sum(x0) + word_sum(x1) + word_sum(x2) + word_sum(x3);
        for (var r = 0u; r < ROWS; r++) {
            acc[r] = block_dot(w[r], x0, x1, x2, x3);
        }
    }
    for (var r = 0u; r < ROWS; r++) {
//#if SUBGROUPS
        let sum = subgroupAdd(acc[r] - xsum);
        if (sg_lane == 0u) {
            atomicAdd(&acc_wg[r], sum);
        }
//#else
        atomicAdd(&acc_wg[r], acc[r] - xsum);
//#endif
    }
    workgroupBarrier();
    if (lid < OUTS) {
        let o = g * OUTS + lid;
        if (o < OUT_W) {
            let inv_s = 1.0 / s;
            let y = wscale[weight_row(g, lid)] * inv_s * f32(atomicLoad(&acc_wg[lid]));
            if (GATED) {
                let u = wscale[weight_row(g, lid + OUTS)] * inv_s * f32(atomicLoad(&acc_wg[lid + OUTS]));
                out[t * OUT_W + o] = activate(y) * u;
            } else if (EPILOGUE == 1u) {
                out[t * OUT_W + o] += y;
            } else {
                out[t * OUT_W + o] = y;
            }
        }
    }
}
