// RMSNorm with f32 output (the final norm before the LM head).
//
//   y = x / sqrt(mean(x^2) + EPS) * weight
//
// Bindings:
//   0 params  uniform StepParams   n_tokens bounds the rows
//   1 x       [T, W/4] vec4<f32>   input rows
//   2 weight  [W/4] vec4<f32>      RMSNorm weight
//   3 y       [T, W/4] vec4<f32>   output rows
//
// Mapping: one workgroup of WG threads per row, vec4 items lid + i*WG (i < ITEMS).
// LAST_ONLY: a single workgroup normalizes row n_tokens - 1 into row 0 of y (decode and the
// last prompt token need only that row's logits).
// Dispatch: (n_tokens, 1, 1), or (1, 1, 1) with LAST_ONLY.

${STEP_PARAMS}

const W4: u32 = ${W4};
const WG: u32 = ${WG};
const ITEMS: u32 = ${ITEMS};
const EPS: f32 = ${EPS};
const W_F: f32 = ${W_F};

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> weight: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<vec4<f32>>;

var<workgroup> red: array<f32, WG>;
var<workgroup> n_slots_wg: u32;

//#if SUBGROUPS
// One slot per subgroup, summed in a fixed order by every thread (deterministic).
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
//#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
//#if LAST_ONLY
    let t_in = params.n_tokens - 1u;
    let t_out = 0u;
//#else
    let t_in = wid.x;
    let t_out = wid.x;
    if (t_in >= params.n_tokens) {
        return;
    }
//#endif
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
//#endif
    var ss = 0.0;
//#for i in ITEMS
    let c{{i}} = lid + {{i}}u * WG;
    let v{{i}} = select(vec4<f32>(0.0), x[t_in * W4 + min(c{{i}}, W4 - 1u)], c{{i}} < W4);
    let w{{i}} = weight[min(c{{i}}, W4 - 1u)];  // loaded with x, before the reduction
    ss += dot(v{{i}}, v{{i}});
//#endfor
//#if SUBGROUPS
    let total = reduce_sum(ss, lid, sg_size, sg_lane, n_slots);
//#else
    let total = reduce_sum(ss, lid);
//#endif
    let r = 1.0 / sqrt(total / W_F + EPS);
//#for i in ITEMS
    if (c{{i}} < W4) {
        y[t_out * W4 + c{{i}}] = v{{i}} * r * w{{i}};
    }
//#endfor
}
