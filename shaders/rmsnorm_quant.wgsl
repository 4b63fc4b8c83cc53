// RMSNorm + per-token int8 quantization (the input side of every BitLinear).
//
//   y = x / sqrt(mean(x^2) + EPS) * weight          (NORMALIZE; weight only with HAS_WEIGHT)
//   s = 127 / max(max|y|, 1e-5)
//   xq = clamp(round(y * s), -128, 127)              round() is half-to-even, like np.round
//   scale_out[t] = 1 / s                             the GEMV multiplies by it
//
// Bindings:
//   0 params     uniform StepParams       n_tokens bounds the rows
//   1 x          [T, W/4] vec4<f32>       input rows
//   2 weight     [W/4] vec4<f32>          RMSNorm weight (only with HAS_WEIGHT; later bindings shift down)
//   3 xq         [T, W/4] u32             4 int8 per word, value 4i+e in byte e
//   4 scale_out  [T] f32                  1 / s per row
//
// Mapping: one workgroup of WG threads per row; thread lid holds vec4 items lid + i*WG
// (i < ITEMS) in registers across the three reductions (sum of squares, absmax).
// Dispatch: (n_tokens, 1, 1).

${STEP_PARAMS}

const W4: u32 = ${W4};
const WG: u32 = ${WG};
const ITEMS: u32 = ${ITEMS};
const EPS: f32 = ${EPS};
const W_F: f32 = ${W_F};

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#if HAS_WEIGHT
@group(0) @binding(2) var<storage, read> weight: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> xq: array<u32>;
@group(0) @binding(4) var<storage, read_write> scale_out: array<f32>;
//#else
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;
@group(0) @binding(3) var<storage, read_write> scale_out: array<f32>;
//#endif

var<workgroup> red: array<f32, WG>;
var<workgroup> n_slots_wg: u32;

//#if SUBGROUPS
// Subgroup sums land in one slot per subgroup (subgroups of a 1-D workgroup are consecutive
// ranges of local_invocation_index); every thread then adds the slots in the same order, so
// all threads get the same, run-to-run deterministic total.
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
// Tree reductions in workgroup memory (WG is a power of two).
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

fn pack_i8(q: vec4<i32>) -> u32 {
    let b = bitcast<vec4<u32>>(q) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let t = wid.x;
    if (t >= params.n_tokens) {
        return;
    }
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
//#endif
    var v: array<vec4<f32>, ITEMS>;
    var ss = 0.0;
    for (var i = 0u; i < ITEMS; i++) {
        let c = lid + i * WG;
        if (c < W4) {
            v[i] = x[t * W4 + c];
        } else {
            v[i] = vec4<f32>(0.0);
        }
        ss += dot(v[i], v[i]);
    }
//#if NORMALIZE
//#if SUBGROUPS
    let total = reduce_sum(ss, lid, sg_size, sg_lane, n_slots);
//#else
    let total = reduce_sum(ss, lid);
//#endif
    let r = 1.0 / sqrt(total / W_F + EPS);
    for (var i = 0u; i < ITEMS; i++) {
        let c = min(lid + i * WG, W4 - 1u);
//#if HAS_WEIGHT
        v[i] = v[i] * r * weight[c];
//#else
        v[i] = v[i] * r;
//#endif
    }
//#endif
    var amax = 0.0;
    for (var i = 0u; i < ITEMS; i++) {
        let a = abs(v[i]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
//#if SUBGROUPS
    amax = reduce_max(amax, lid, sg_size, sg_lane, n_slots);
//#else
    amax = reduce_max(amax, lid);
//#endif
    let s = 127.0 / max(amax, 1e-5);
    for (var i = 0u; i < ITEMS; i++) {
        let c = lid + i * WG;
        if (c < W4) {
            let q = clamp(round(v[i] * s), vec4<f32>(-128.0), vec4<f32>(127.0));
            xq[t * W4 + c] = pack_i8(vec4<i32>(q));
        }
    }
    if (lid == 0u) {
        scale_out[t] = 1.0 / s;
    }
}
