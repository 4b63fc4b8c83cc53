// The int8 screen of greedy decoding's LM head (kernels/head_screen.py): which rows can hold the
// largest logit, from half the bytes of the F16 head.
//
// QUANTIZE (once, at load): row r of an F16 shard -> int8 values q and one scale s = max|w| / 127
// (q = clamp(round(w / s), -127, 127)), and the row's error norm
//   errs[r] = (||w - s q||_2 + SLACK * ||w||_2) * 1.01
// so that for any x, |F16 head logit - s * sum q x| <= errs[r] * ||x||_2: Cauchy-Schwarz bounds the
// rounding residual's part, SLACK (about twice the row length times float32's unit roundoff) the
// float32 rounding of both sums in any order, and 1% covers the rounding of these norms themselves.
//   Bindings: 0 table [SHARD_ROWS, D8] vec4<u32> (8 F16 halves each), 1 table_i8 [SHARD_ROWS, D16]
//   vec4<u32> (16 int8 each, byte 0 first), 2 scales [V] f32, 3 errs [V] f32 (both at START + r).
//   Workgroup g handles rows g, g + QGROUPS, ...; WG threads (a power of two) take int8 chunks
//   lid, lid + WG, ... of the row. Dispatch (QGROUPS, 1, 1).
//
// SCREEN (every greedy decode step): for each row the approximate logit z = s * sum q x, then
//   upper[START + r] = z + errs[r] * ||x||_2    and    lower = z - errs[r] * ||x||_2,
// and the workgroup's largest lower bound goes into keys[g % KEY_SLOTS] by atomicMax over order keys
// (a u32 that orders as the float does; spreading the maxima over KEY_SLOTS words keeps the atomics
// from queueing on one address). Rows from VOCAB on are left out. The argmax's row has upper >= every lower bound, so lm_head.wgsl
// RESCORE keeps every row whose upper bound reaches the largest key. NaN bounds count for nothing.
// WHOLE: D16 is a multiple of WG (no clamps or zero selects).
//   Bindings: 0 table_i8, 1 scales, 2 errs, 3 x [D/4] vec4<f32>, 4 upper [V] f32, 5 keys
//   [KEY_SLOTS] atomic<u32> (zero before the step: argmax.wgsl's SCREENED combine clears them).
//   Mapping as lm_head.wgsl's: ROWS rows per workgroup, thread lid takes chunks lid, lid + WG, ...,
//   every load issued first; ||x||^2 is reduced with the rows. Dispatch (ceil(SHARD_ROWS / ROWS), 1, 1).

const D16: u32 = ${D16};  // 16-byte int8 chunks per row (D8 = 2 * D16 F16 chunks)
const SHARD_ROWS: u32 = ${SHARD_ROWS};
const START: u32 = ${START};
const WG: u32 = ${WG};

//#if QUANTIZE
const QGROUPS: u32 = ${QGROUPS};
const SLACK: f32 = ${SLACK};
const QITERS: u32 = (D16 + WG - 1u) / WG;

@group(0) @binding(0) var<storage, read> table: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> table_i8: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> scales: array<f32>;
@group(0) @binding(3) var<storage, read_write> errs: array<f32>;

var<workgroup> red_a: array<f32, WG>;
var<workgroup> red_b: array<f32, WG>;

// The 16 F16 values of int8 chunk j of row `row`, as 4 vec4 (columns 16j .. 16j + 15).
fn halves(row: u32, j: u32, part: u32) -> vec4<f32> {
    let chunk = table[row * 2u * D16 + 2u * j + part / 2u];
    if (part % 2u == 0u) {
        return vec4<f32>(unpack2x16float(chunk.x), unpack2x16float(chunk.y));
    }
    return vec4<f32>(unpack2x16float(chunk.z), unpack2x16float(chunk.w));
}

fn pack_i8(q: vec4<f32>) -> u32 {
    let b = bitcast<vec4<u32>>(vec4<i32>(q)) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

// Sums (a, b) over the workgroup (a tree: this runs once, at load).
fn reduce_pair(a: f32, b: f32, lid: u32, is_max: bool) -> vec2<f32> {
    red_a[lid] = a;
    red_b[lid] = b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            if (is_max) {
                red_a[lid] = max(red_a[lid], red_a[lid + stride]);
            } else {
                red_a[lid] += red_a[lid + stride];
                red_b[lid] += red_b[lid + stride];
            }
        }
        workgroupBarrier();
    }
    let out = vec2<f32>(red_a[0], red_b[0]);
    workgroupBarrier();  // the arrays are the next reduction's
    return out;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    for (var row = wid.x; row < SHARD_ROWS; row += QGROUPS) {
        var m = 0.0;
        for (var it = 0u; it < QITERS; it++) {
            let j = lid + it * WG;
            if (j < D16) {
                for (var part = 0u; part < 4u; part++) {
                    let a = abs(halves(row, j, part));
                    m = max(m, max(max(a.x, a.y), max(a.z, a.w)));
                }
            }
        }
        let s = reduce_pair(m, 0.0, lid, true).x / 127.0;
        let div = select(1.0, s, s > 0.0);  // a zero row: q = 0
        var dd = 0.0;
        var ww = 0.0;
        for (var it = 0u; it < QITERS; it++) {
            let j = lid + it * WG;
            if (j < D16) {
                var words: array<u32, 4>;
                for (var part = 0u; part < 4u; part++) {
                    let w = halves(row, j, part);
                    let q = clamp(round(w / div), vec4<f32>(-127.0), vec4<f32>(127.0));
                    let d = w - s * q;
                    dd += dot(d, d);
                    ww += dot(w, w);
                    words[part] = pack_i8(q);
                }
                table_i8[row * D16 + j] = vec4<u32>(words[0], words[1], words[2], words[3]);
            }
        }
        let sums = reduce_pair(dd, ww, lid, false);
        if (lid == 0u) {
            scales[START + row] = s;
            errs[START + row] = (sqrt(sums.x) + SLACK * sqrt(sums.y)) * 1.01;
        }
    }
}
//#else
const ROWS: u32 = ${ROWS};
const SLOTS: u32 = ${SLOTS};  // reduction slots: WG / (smallest subgroup size), or WG
const ITERS: u32 = ${ITERS};  // ceil(D16 / WG)
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const VOCAB: u32 = ${VOCAB};  // rows from here on are left out (never the argmax)
const SUMS: u32 = ROWS + 1u;  // reduced per workgroup: the rows and ||x||^2

@group(0) @binding(0) var<storage, read> table_i8: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> scales: array<f32>;
@group(0) @binding(2) var<storage, read> errs: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> upper: array<f32>;
@group(0) @binding(5) var<storage, read_write> keys: array<atomic<u32>>;

var<workgroup> red: array<f32, SUMS * SLOTS>;
var<workgroup> n_slots_wg: u32;

// Four int8 values of a little-endian word, sign-extended (byte 0 is the first column).
fn int8x4(word: u32) -> vec4<f32> {
    let w = bitcast<i32>(word);
    return vec4<f32>(f32((w << 24u) >> 24u), f32((w << 16u) >> 24u), f32((w << 8u) >> 24u), f32(w >> 24u));
}

// A u32 that orders as the float does (negative floats below positive ones, -0 just below +0).
fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, b >= 0x80000000u);
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
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let slot = lid / sg_size;
//#else
    let slot = lid;
//#endif
//#for it in ITERS
    let c{{it}} = lid + {{it}}u * WG;
//#if WHOLE
    let cc{{it}} = c{{it}};
//#else
    let cc{{it}} = min(c{{it}}, D16 - 1u);
//#endif
//#for r in ROWS
    let w{{it}}_{{r}} = table_i8[min(g * ROWS + {{r}}u, SHARD_ROWS - 1u) * D16 + cc{{it}}];
//#endfor
//#endfor
    var xx = 0.0;
//#for r in ROWS
    var acc{{r}} = 0.0;
//#endfor
//#for it in ITERS
//#if WHOLE
    let xa{{it}} = x[4u * cc{{it}}];
    let xb{{it}} = x[4u * cc{{it}} + 1u];
    let xc{{it}} = x[4u * cc{{it}} + 2u];
    let xd{{it}} = x[4u * cc{{it}} + 3u];
//#else
    let inside{{it}} = c{{it}} < D16;
    let xa{{it}} = select(vec4<f32>(0.0), x[4u * cc{{it}}], inside{{it}});
    let xb{{it}} = select(vec4<f32>(0.0), x[4u * cc{{it}} + 1u], inside{{it}});
    let xc{{it}} = select(vec4<f32>(0.0), x[4u * cc{{it}} + 2u], inside{{it}});
    let xd{{it}} = select(vec4<f32>(0.0), x[4u * cc{{it}} + 3u], inside{{it}});
//#endif
    xx += dot(xa{{it}}, xa{{it}}) + dot(xb{{it}}, xb{{it}}) + dot(xc{{it}}, xc{{it}}) + dot(xd{{it}}, xd{{it}});
//#endfor
//#for it in ITERS
//#for r in ROWS
    acc{{r}} += dot(int8x4(w{{it}}_{{r}}.x), xa{{it}}) + dot(int8x4(w{{it}}_{{r}}.y), xb{{it}})
              + dot(int8x4(w{{it}}_{{r}}.z), xc{{it}}) + dot(int8x4(w{{it}}_{{r}}.w), xd{{it}});
//#endfor
//#endfor
//#if SUBGROUPS
    let n_slots = workgroupUniformLoad(&n_slots_wg);
    let sxx = subgroupAdd(xx);
//#for r in ROWS
    let s{{r}} = subgroupAdd(acc{{r}});
//#endfor
    if (sg_lane == 0u) {
//#for r in ROWS
        red[{{r}}u * SLOTS + slot] = s{{r}};
//#endfor
        red[ROWS * SLOTS + slot] = sxx;
    }
//#else
    let n_slots = WG;
//#for r in ROWS
    red[{{r}}u * SLOTS + lid] = acc{{r}};
//#endfor
    red[ROWS * SLOTS + lid] = xx;
//#endif
    workgroupBarrier();
    if (lid == 0u) {
        var norm2 = 0.0;
        for (var i = 0u; i < n_slots; i++) {
            norm2 += red[ROWS * SLOTS + i];
        }
        let x_norm = sqrt(norm2);
        var best = 0u;  // no bound yet (0 is below every float's key)
        for (var r = 0u; r < ROWS; r++) {
            let row = g * ROWS + r;
            if (row < SHARD_ROWS && START + row < VOCAB) {
                var total = 0.0;
                for (var i = 0u; i < n_slots; i++) {
                    total += red[r * SLOTS + i];
                }
                let z = total * scales[START + row];
                let e = errs[START + row] * x_norm;
                upper[START + row] = z + e;
                let lower = z - e;
                if (lower == lower) {
                    best = max(best, order_key(lower));
                }
            }
        }
        if (best != 0u) {
            atomicMax(&keys[g % KEY_SLOTS], best);
        }
    }
}
//#endif
