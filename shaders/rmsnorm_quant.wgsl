// RMSNorm + per-token int8 quantization (the input side of every BitLinear).
//
//   y = x / sqrt(mean(x^2) + EPS) * weight          (NORMALIZE; weight only with HAS_WEIGHT)
//   s = 127 / max(max|y|, 1e-5)
//   xq = clamp(round(y * s), -128, 127)              round() is half-to-even, like np.round
//   scale_out[t] = 1 / s                             the GEMV multiplies by it
//
// Computed as h = x * weight, r = 1 / sqrt(mean(x^2) + EPS), max|y| = r * max|h|, xq = round(h * (r * s)):
// sum of squares and absmax need no result of each other, so ONE reduction round gives both (the
// codes equal the formula's except within float32 rounding of a .5 tie).
//
// Bindings:
//   0 params     uniform StepParams       n_tokens bounds the rows
//   1 x          [T, W/4] vec4<f32>       input rows
//   2 weight     [W/4] vec4<f32>          RMSNorm weight (only with HAS_WEIGHT; later bindings shift down)
//   3 xq         [T, W/4] u32             4 int8 per word, value 4i+e in byte e
//   4 scale_out  [T] f32                  1 / s per row
//
// Mapping: one workgroup of WG threads per row; thread lid holds vec4 items lid + i*WG
// (i < ITEMS, unrolled `let`s) in registers across the reduction (sum of squares and absmax together).
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

//#include _norm_reduce

//#include _int8

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
    var ss = 0.0;
    var mx = 0.0;
//#for i in ITEMS
    let c{{i}} = lid + {{i}}u * WG;
    let cc{{i}} = min(c{{i}}, W4 - 1u);
    let v{{i}} = select(vec4<f32>(0.0), x[t * W4 + cc{{i}}], c{{i}} < W4);
//#if HAS_WEIGHT
    let h{{i}} = v{{i}} * weight[cc{{i}}];
//#else
    let h{{i}} = v{{i}};
//#endif
    ss += dot(v{{i}}, v{{i}});
    let a{{i}} = abs(h{{i}});
    mx = max(mx, max(max(a{{i}}.x, a{{i}}.y), max(a{{i}}.z, a{{i}}.w)));
//#endfor
//#if SUBGROUPS
    let red = reduce_sum_max(ss, mx, lid, sg_size, sg_lane);
//#else
    let red = reduce_sum_max(ss, mx, lid);
//#endif
    let total = red.x;
    let amax = red.y;
//#if NORMALIZE
    let r = 1.0 / sqrt(total / W_F + EPS);
//#else
    let r = 1.0;
//#endif
    let s = 127.0 / max(amax * r, 1e-5);
    let k = r * s;
//#for i in ITEMS
    if (c{{i}} < W4) {
        xq[t * W4 + c{{i}}] = pack_i8(clamp(round(h{{i}} * k), vec4<f32>(-128.0), vec4<f32>(127.0)));
    }
//#endfor
    if (lid == 0u) {
        scale_out[t] = 1.0 / s;
    }
}
