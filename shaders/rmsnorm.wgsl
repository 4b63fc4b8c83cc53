// RMSNorm with f32 output (the final norm before the LM head).
//
//   y = x / sqrt(mean(x^2) + EPS) * weight
//
// Bindings:
//   0 params  uniform StepParams   n_tokens bounds the rows
//   1 x       [T, W/4] vec4<f32>   input rows
//   2 weight  [W/4] vec4<f32>      RMSNorm weight
//   3 y       [T, W/4] vec4<f32>   output rows
//   DIGITS only (the screened LM head's input, kernels/head_screen.py):
//   4 digits  [T, 2, W/4] u32      y in two int8 digits, y ~ s1 * q1 + s2 * q2: a row's q1 words, then q2
//   5 stats   [T, 4] f32           s1, s2, ||s1 q1 + s2 q2||, ||y - s1 q1 - s2 q2|| of each row
//
// Mapping: one workgroup of WG threads per row, vec4 items lid + i*WG (i < ITEMS).
// LAST_ONLY: a single workgroup normalizes row n_tokens - 1 into row 0 of y (decode and the
// last prompt token need only that row's logits). DIGITS (decode steps' LAST_ONLY row, or every row
// of a verify step): s1 = max|y| / 127,
// q1 = round(y / s1), and the remainder (|y - s1 q1| <= s1 / 2) in steps of s2 = s1 / 254, so q2 is
// in -127..127 too; the residual after both is at most s2 / 2 an element. max|y| comes from the
// same reduction as the sum of squares (y = x * r * weight with one r > 0 for the row).
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
//#if DIGITS
@group(0) @binding(4) var<storage, read_write> digits: array<u32>;
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;

//#include _int8
//#endif

//#include _norm_reduce

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
    var ss = 0.0;
    var mx = 0.0;
//#for i in ITEMS
    let c{{i}} = lid + {{i}}u * WG;
    let v{{i}} = select(vec4<f32>(0.0), x[t_in * W4 + min(c{{i}}, W4 - 1u)], c{{i}} < W4);
    let w{{i}} = weight[min(c{{i}}, W4 - 1u)];  // loaded with x, before the reduction
    ss += dot(v{{i}}, v{{i}});
//#if DIGITS
    let m{{i}} = abs(v{{i}} * w{{i}});
    mx = max(mx, max(max(m{{i}}.x, m{{i}}.y), max(m{{i}}.z, m{{i}}.w)));
//#endif
//#endfor
//#if SUBGROUPS
    let sum_max = reduce_sum_max(ss, mx, lid, sg_size, sg_lane);
//#else
    let sum_max = reduce_sum_max(ss, mx, lid);
//#endif
    let r = 1.0 / sqrt(sum_max.x / W_F + EPS);
//#if DIGITS
    let s1 = sum_max.y * r / 127.0;
    let s2 = s1 / 254.0;
    let div1 = select(1.0, s1, s1 > 0.0);  // y = 0: both digits 0
    let div2 = select(1.0, s2, s2 > 0.0);
    var aa = 0.0;
    var bb = 0.0;
//#endif
//#for i in ITEMS
    let y{{i}} = v{{i}} * r * w{{i}};
    if (c{{i}} < W4) {
        y[t_out * W4 + c{{i}}] = y{{i}};
    }
//#if DIGITS
    let q1_{{i}} = clamp(round(y{{i}} / div1), vec4<f32>(-127.0), vec4<f32>(127.0));
    let q2_{{i}} = clamp(round((y{{i}} - s1 * q1_{{i}}) / div2), vec4<f32>(-127.0), vec4<f32>(127.0));
    let yd{{i}} = s1 * q1_{{i}} + s2 * q2_{{i}};
    let rd{{i}} = y{{i}} - yd{{i}};
    if (c{{i}} < W4) {
        digits[2u * t_out * W4 + c{{i}}] = pack_i8(q1_{{i}});
        digits[(2u * t_out + 1u) * W4 + c{{i}}] = pack_i8(q2_{{i}});
        aa += dot(yd{{i}}, yd{{i}});
        bb += dot(rd{{i}}, rd{{i}});
    }
//#endif
//#endfor
//#if DIGITS
    workgroupBarrier();  // the reduction's slots are read by every thread before they are reused
//#if SUBGROUPS
    let norms = reduce_sum_pair(aa, bb, lid, sg_size, sg_lane);
//#else
    let norms = reduce_sum_pair(aa, bb, lid);
//#endif
    if (lid == 0u) {
        stats[4u * t_out] = s1;
        stats[4u * t_out + 1u] = s2;
        stats[4u * t_out + 2u] = sqrt(norms.x);
        stats[4u * t_out + 3u] = sqrt(norms.y);
    }
//#endif
}
