// LM head over one row shard of an F16 matrix (the tied token embedding, or an output matrix).
//
//   logits[t, START + r] = sum_d f32(table[r, d]) * x[t, d]      r < SHARD_ROWS
//
// Bindings:
//   0 table   [SHARD_ROWS, D/8] vec4<u32>   F16 rows, 8 halves per vec4<u32> (16-byte loads)
//   1 x       [T, D/4] vec4<f32>            normed hidden states
//   2 logits  [T, V] f32                    this shard writes columns START .. START + SHARD_ROWS
//   3 params  uniform StepParams            only with MULTI: n_tokens bounds the token rows
//
// Mapping: a workgroup of WG threads computes ROWS rows for TOK tokens; thread lid takes 16-byte
// chunks lid, lid+WG, ... of each row, converts them once and reuses them for the TOK tokens.
// Partial sums reduce through subgroupAdd into one slot per subgroup (or one per thread without
// subgroups), summed in a fixed order: results are deterministic run to run.
// Dispatch: (ceil(SHARD_ROWS / ROWS), ceil(T / TOK), 1); without MULTI, TOK = 1 and T = 1.

const D8: u32 = ${D8};
const SHARD_ROWS: u32 = ${SHARD_ROWS};
const START: u32 = ${START};
const V: u32 = ${V};
const ROWS: u32 = ${ROWS};
const TOK: u32 = ${TOK};
const WG: u32 = ${WG};

const ITERS: u32 = (D8 + WG - 1u) / WG;
const D4: u32 = D8 * 2u;
const OUTS: u32 = ROWS * TOK;

//#if MULTI
${STEP_PARAMS}
//#endif

@group(0) @binding(0) var<storage, read> table: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
//#if MULTI
@group(0) @binding(3) var<uniform> params: StepParams;
//#endif

var<workgroup> red: array<f32, OUTS * WG>;
var<workgroup> n_slots_wg: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let g = wid.x;
//#if MULTI
    let n_tokens = params.n_tokens;
//#else
    let n_tokens = 1u;
//#endif
    let t0 = wid.y * TOK;
    var acc: array<f32, OUTS>;
    for (var it = 0u; it < ITERS; it++) {
        let c = lid + it * WG;
        if (c < D8) {
            var w: array<vec4<u32>, ROWS>;
            for (var r = 0u; r < ROWS; r++) {
                w[r] = table[min(g * ROWS + r, SHARD_ROWS - 1u) * D8 + c];
            }
            for (var m = 0u; m < TOK; m++) {
                let t = min(t0 + m, n_tokens - 1u);
                let xa = x[t * D4 + 2u * c];
                let xb = x[t * D4 + 2u * c + 1u];
                for (var r = 0u; r < ROWS; r++) {
                    let wa = vec4<f32>(unpack2x16float(w[r].x), unpack2x16float(w[r].y));
                    let wb = vec4<f32>(unpack2x16float(w[r].z), unpack2x16float(w[r].w));
                    acc[r * TOK + m] += dot(wa, xa) + dot(wb, xb);
                }
            }
        }
    }
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
    for (var o = 0u; o < OUTS; o++) {
        let s = subgroupAdd(acc[o]);
        if (sg_lane == 0u) {
            red[o * WG + lid / sg_size] = s;
        }
    }
//#else
    let n_slots = WG;
    for (var o = 0u; o < OUTS; o++) {
        red[o * WG + lid] = acc[o];
    }
//#endif
    workgroupBarrier();
    for (var o = lid; o < OUTS; o += WG) {
        let r = o / TOK;
        let t = t0 + o % TOK;
        let row = g * ROWS + r;
        if (row < SHARD_ROWS && t < n_tokens) {
            var total = 0.0;
            for (var i = 0u; i < n_slots; i++) {
                total += red[o * WG + i];
            }
            logits[t * V + START + row] = total;
        }
    }
}
