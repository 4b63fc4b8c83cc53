// The int8 screen of greedy decoding's LM head (kernels/head_screen.py): which rows can hold the
// largest logit, from half the bytes of the F16 head.
//
// QUANTIZE (once, at load): row r of an F16 shard -> int8 values q and one scale s = max|w| / 127
// (q = clamp(round(w / s), -127, 127)), and the norms (||w - s q||_2, ||w||_2) of the row's rounding
// residual and of the row itself.
//   Bindings: 0 table [SHARD_ROWS, D8] vec4<u32> (8 F16 halves each), 1 table_i8 [SHARD_ROWS, D16]
//   vec4<u32> (16 int8 each, byte 0 first), 2 scales [V] f32, 3 norms [V] vec2<f32> (both at START + r).
//   Workgroup g handles rows g, g + QGROUPS, ...; WG threads (a power of two) take int8 chunks
//   lid, lid + WG, ... of the row. Dispatch (QGROUPS, 1, 1).
//
// SCREEN (every greedy decode step): the input y arrives as two int8 digits, y = s1 q1 + s2 q2 + d
// (rmsnorm.wgsl DIGITS, with A = ||s1 q1 + s2 q2|| and B = ||d||), so each row's approximate logit
//   z = s * (s1 * sum q q1 + s2 * sum q q2)
// is two exact integer dot products (dot4I8Packed). With w = s q + e_w and y~ = s1 q1 + s2 q2,
//   w . y - z = e_w . y~ + w . d,    so    |F16 logit - z| <= ||e_w|| A + ||w|| (B + SLACK (A + B))
// by Cauchy-Schwarz, where SLACK (about twice the row length times float32's unit roundoff, ||y|| <=
// A + B) bounds the float32 rounding of the F16 head's sum and of z, and a factor 1.01 the rounding of
// the norms. Each row's upper bound z + e goes to upper[START + r]; the workgroup's largest lower
// bound z - e goes into keys[g % KEY_SLOTS] by atomicMax over order keys (a u32 that orders as the
// float does; spreading the maxima over KEY_SLOTS words keeps the atomics from queueing on one
// address). Rows from VOCAB on are left out. The argmax's row has upper >= every lower bound, so
// lm_head.wgsl RESCORE keeps every row whose upper bound reaches the largest key. NaN bounds count
// for nothing. WHOLE: D16 is a multiple of WG (no clamps or zero selects).
// TOKENS > 1: a verify step's token rows, each with its own digits, bounds and keys; the weights are
// read once for all of them. BOUNDED: StepParams' n_tokens bounds the rows (a shorter draft's rows
// cost nothing and set no keys, so the rescore keeps nothing there).
//   Bindings: 0 table_i8, 1 scales, 2 norms, 3 digits [TOKENS, 2, D16] vec4<u32> (a row's q1, then q2),
//   4 stats [TOKENS, 4] f32 (s1, s2, A, B), 5 upper [TOKENS, VOCAB] f32, 6 keys [TOKENS, KEY_STRIDE]
//   atomic<u32> (a row's first KEY_SLOTS zero before the step: argmax.wgsl's SCREENED combine, a draw or
//   lm_head_screen_tau.wgsl CLEAR clears them), 7 params (BOUNDED).
//   Mapping: ROWS rows per workgroup, thread lid takes chunks lid, lid + WG, ..., every weight load
//   issued first (the rows' scales and norms too, so none waits behind the sums); integer partials are
//   summed exactly (subgroupAdd, then one slot per subgroup, or per thread without subgroups); thread t
//   turns token row t's sums into bounds. Dispatch (ceil(SHARD_ROWS / ROWS), 1, 1).

const D16: u32 = ${D16};  // 16-byte int8 chunks per row (D8 = 2 * D16 F16 chunks)
const SHARD_ROWS: u32 = ${SHARD_ROWS};
const START: u32 = ${START};
const WG: u32 = ${WG};

//#if QUANTIZE
const QGROUPS: u32 = ${QGROUPS};
const QITERS: u32 = (D16 + WG - 1u) / WG;

@group(0) @binding(0) var<storage, read> table: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> table_i8: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> scales: array<f32>;
@group(0) @binding(3) var<storage, read_write> norms: array<vec2<f32>>;

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

//#include _int8

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
            norms[START + row] = vec2<f32>(sqrt(sums.x), sqrt(sums.y));
        }
    }
}
//#else
const ROWS: u32 = ${ROWS};
const TOKENS: u32 = ${TOKENS};  // token rows (a verify step's; 1 for a decode step)
const SLOTS: u32 = ${SLOTS};  // reduction slots: WG / (smallest subgroup size), or WG
const ITERS: u32 = ${ITERS};  // ceil(D16 / WG)
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const KEY_STRIDE: u32 = ${KEY_STRIDE};  // words between token rows' keys (KEY_SLOTS, + 1 where a tau follows)
const VOCAB: u32 = ${VOCAB};  // rows from here on are left out (never the argmax)
const SLACK: f32 = ${SLACK};
//#if BOUNDED
${STEP_PARAMS}
//#endif

@group(0) @binding(0) var<storage, read> table_i8: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> scales: array<f32>;
@group(0) @binding(2) var<storage, read> norms: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> digits: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> stats: array<f32>;
@group(0) @binding(5) var<storage, read_write> upper: array<f32>;
@group(0) @binding(6) var<storage, read_write> keys: array<atomic<u32>>;
//#if BOUNDED
@group(0) @binding(7) var<uniform> params: StepParams;
//#endif

var<workgroup> red: array<i32, 2u * TOKENS * ROWS * SLOTS>;  // [((t ROWS + r) 2 + digit) SLOTS + slot]
var<workgroup> n_slots_wg: u32;

//#include _int8

//#include _order_key

fn dot16(w: vec4<u32>, x: vec4<u32>) -> i32 {
    return dot4(w.x, x.x) + dot4(w.y, x.y) + dot4(w.z, x.z) + dot4(w.w, x.w);
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
//#if BOUNDED
    let n_tokens = min(params.n_tokens, TOKENS);
//#else
    let n_tokens = TOKENS;
//#endif
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
    // each row's scale and norms and the digits' stats, loaded with the weights (used after the sums)
//#for r in ROWS
    let at{{r}} = START + min(g * ROWS + {{r}}u, SHARD_ROWS - 1u);
    let sc{{r}} = scales[at{{r}}];
    let nm{{r}} = norms[at{{r}}];
//#endfor
    let ts = min(lid, TOKENS - 1u);  // the token row whose bounds this thread writes (lid < n_tokens)
    let st = vec4<f32>(stats[4u * ts], stats[4u * ts + 1u], stats[4u * ts + 2u], stats[4u * ts + 3u]);
//#if SUBGROUPS
    let n_slots = workgroupUniformLoad(&n_slots_wg);
//#else
    let n_slots = WG;
//#endif
//#for t in TOKENS
    if ({{t}}u < n_tokens) {  // uniform
//#for it in ITERS
//#if WHOLE
        let p{{t}}_{{it}} = digits[2u * {{t}}u * D16 + cc{{it}}];
        let q{{t}}_{{it}} = digits[(2u * {{t}}u + 1u) * D16 + cc{{it}}];
//#else
        let p{{t}}_{{it}} = select(vec4<u32>(0u), digits[2u * {{t}}u * D16 + cc{{it}}], c{{it}} < D16);
        let q{{t}}_{{it}} = select(vec4<u32>(0u), digits[(2u * {{t}}u + 1u) * D16 + cc{{it}}], c{{it}} < D16);
//#endif
//#endfor
//#for r in ROWS
        var a{{t}}_{{r}} = 0i;
        var b{{t}}_{{r}} = 0i;
//#endfor
//#for it in ITERS
//#for r in ROWS
        a{{t}}_{{r}} += dot16(w{{it}}_{{r}}, p{{t}}_{{it}});
        b{{t}}_{{r}} += dot16(w{{it}}_{{r}}, q{{t}}_{{it}});
//#endfor
//#endfor
//#if SUBGROUPS
//#for r in ROWS
        let sa{{t}}_{{r}} = subgroupAdd(a{{t}}_{{r}});
        let sb{{t}}_{{r}} = subgroupAdd(b{{t}}_{{r}});
//#endfor
        if (sg_lane == 0u) {
//#for r in ROWS
            red[(2u * ({{t}}u * ROWS + {{r}}u)) * SLOTS + slot] = sa{{t}}_{{r}};
            red[(2u * ({{t}}u * ROWS + {{r}}u) + 1u) * SLOTS + slot] = sb{{t}}_{{r}};
//#endfor
        }
//#else
//#for r in ROWS
        red[(2u * ({{t}}u * ROWS + {{r}}u)) * SLOTS + lid] = a{{t}}_{{r}};
        red[(2u * ({{t}}u * ROWS + {{r}}u) + 1u) * SLOTS + lid] = b{{t}}_{{r}};
//#endfor
//#endif
    }
//#endfor
    workgroupBarrier();
    if (lid < n_tokens) {  // thread t: token row t's bounds
        let t = lid;
        let rest = st.w + SLACK * (st.z + st.w);  // B + SLACK (A + B)
        var best = 0u;  // no bound yet (0 is below every float's key)
//#for r in ROWS
        {
            let row = g * ROWS + {{r}}u;
            var ta = 0i;
            var tb = 0i;
            for (var i = 0u; i < n_slots; i++) {
                ta += red[(2u * (t * ROWS + {{r}}u)) * SLOTS + i];
                tb += red[(2u * (t * ROWS + {{r}}u) + 1u) * SLOTS + i];
            }
            let z = sc{{r}} * (st.x * f32(ta) + st.y * f32(tb));
            let e = (nm{{r}}.x * st.z + nm{{r}}.y * rest) * 1.01;
            let lower = z - e;
            if (row < SHARD_ROWS && START + row < VOCAB) {
                upper[t * VOCAB + START + row] = z + e;
                if (lower == lower) {
                    best = max(best, order_key(lower));
                }
            }
        }
//#endfor
        if (best != 0u) {
            atomicMax(&keys[t * KEY_STRIDE + g % KEY_SLOTS], best);
        }
    }
}
//#endif
