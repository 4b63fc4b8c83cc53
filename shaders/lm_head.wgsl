// LM head over one row shard of an F16 matrix (the tied token embedding, or an output matrix),
// or (INT8) of its optional int8 copy with one f32 scale per row (an approximation, half the bytes).
//
//   logits[t, START + r] = sum_d f32(table[r, d]) * x[t, d]                    r < SHARD_ROWS
//   INT8:                = scales[START + r] * sum_d f32(table_i8[r, d]) * x[t, d]
//
// Bindings:
//   0 table   [SHARD_ROWS, D8] vec4<u32>    16-byte chunks: 8 F16 halves, or (INT8) 16 int8 values
//   1 x       [T, D/4] vec4<f32>            normed hidden states
//   2 logits  [T, V] f32                    this shard writes columns START .. START + SHARD_ROWS
//   3 scales  [V] f32                       only with INT8: per-row dequantization scales
//   3|4 params uniform StepParams           only with MULTI: n_tokens bounds the token rows
//
// Mapping: a workgroup of WG threads computes ROWS rows for TOK tokens; thread lid takes 16-byte
// chunks lid, lid+WG, ... of each row. All ITERS * ROWS weight loads are issued before any
// arithmetic (clamped indices, so no branch stands between them), converted once and reused for
// the TOK tokens. Per-thread values are unrolled `let`s (//#for, see common.unroll_loops). Partial sums reduce through subgroupAdd into one slot per subgroup (or one per
// thread without subgroups), summed in a fixed order: results are deterministic run to run.
// Dispatch: (ceil(SHARD_ROWS / ROWS), ceil(T / TOK), 1); without MULTI, TOK = 1 and T = 1.
//
// RESCORE (screened decode steps, kernels/head_screen.py): the exact logits of the rows an int8 screen
// left standing. Workgroup g scans rows g*SLICE .. g*SLICE+SLICE-1 of the shard, keeps those whose upper
// bound reaches tau, then computes the kept rows, ROWS at a time, with the one-row head's arithmetic
// (TOK = 1; each row's own loads, sums and slot order, so the same bits as the full head).
//   greedy: tau = the best lower bound (the largest of the KEY_SLOTS order keys); the workgroup writes
//           its best (value bits, index) to partials[PART_BASE + g] for argmax.wgsl's combine (NaN never
//           wins; equal values keep the smaller index, whatever order the rows were kept in).
//   TOPK:   tau = the TAU_RANK-th largest of the KEY_SLOTS order keys (low 16 bits cleared: a lower
//           bound of it), which lm_head_screen_tau.wgsl wrote to keys[KEY_SLOTS]. Each
//           key is a different row's lower bound, so TAU_RANK rows reach tau, and a row below it is below
//           the top TAU_RANK - (repetition-penalized rows) logits. The kept rows (and NaN bounds) go to the
//           candidate list as (F16 logit bits, row): room for n_kept is taken with one atomicAdd. Fewer
//           than TAU_RANK keys set (tau's key 0): every row is kept. The sampler then sees the F16 head's
//           top logits, bit for bit. LOGITS (a sampled verify step's rows): the kept rows' F16 logits go
//           to logits[t, row] instead, every other row of the slice gets -inf, so the speculative
//           sampler reads the row as the F16 head's wherever its top-k can reach.
// BOUNDED: StepParams' n_tokens bounds the token rows (a row past the draft has no keys set).
// Token row t = workgroup_id.y (greedy: a verify step's rows, each with its own bounds and keys).
// Bindings: 0 table, 1 x [T, D/4], 2 upper [T, VOCAB] f32, 3 keys [T, KEY_STRIDE] u32 (TOPK: the tau
// at KEY_SLOTS), 4 partials [T, PART_ROW] (TOPK: candidates, _candidates.wgsl; LOGITS: logits [T, V]),
// 5 params (BOUNDED).
// Dispatch (ceil(SHARD_ROWS / SLICE), T, 1).

const D8: u32 = ${D8};  // 16-byte chunks per row
const SHARD_ROWS: u32 = ${SHARD_ROWS};
const START: u32 = ${START};
const V: u32 = ${V};
const ROWS: u32 = ${ROWS};
const TOK: u32 = ${TOK};
const WG: u32 = ${WG};
const SLOTS: u32 = ${SLOTS};  // reduction slots per output: WG / (smallest subgroup size), or WG

const ITERS: u32 = ${ITERS};  // ceil(D8 / WG)
//#if INT8
const D4: u32 = D8 * 4u;
//#else
const D4: u32 = D8 * 2u;
//#endif
const OUTS: u32 = ROWS * TOK;

//#if MULTI
${STEP_PARAMS}
//#endif

@group(0) @binding(0) var<storage, read> table: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#if RESCORE
@group(0) @binding(2) var<storage, read> upper: array<f32>;
@group(0) @binding(3) var<storage, read> keys: array<u32>;
//#if TOPK
//#if LOGITS
@group(0) @binding(4) var<storage, read_write> logits: array<f32>;
//#else
//#include _candidates
@group(0) @binding(4) var<storage, read_write> candidates: Candidates;
//#endif
//#else
@group(0) @binding(4) var<storage, read_write> partials: array<vec2<u32>>;
//#endif
//#if BOUNDED
${STEP_PARAMS}
@group(0) @binding(5) var<uniform> params: StepParams;
//#endif
const SLICE: u32 = ${SLICE};
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const KEY_STRIDE: u32 = ${KEY_STRIDE};  // words between token rows' keys
const PART_BASE: u32 = ${PART_BASE};
const PART_ROW: u32 = ${PART_ROW};  // partials per token row (every shard's rescoring workgroups)
const VOCAB: u32 = ${VOCAB};  // rows from here on are never kept
const NO_INDEX: u32 = 0xffffffffu;
var<workgroup> kept: array<u32, SLICE>;
var<workgroup> n_kept_at: atomic<u32>;
var<workgroup> n_kept_wg: u32;
//#if !TOPK
var<workgroup> key_at: atomic<u32>;
//#endif
//#if LOGITS
var<private> neg_inf_bits: u32 = 0xff800000u;  // -inf (a private, not a constant: Tint refuses -inf values)
//#endif

//#include _order_key
//#else
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
//#endif
//#if INT8
@group(0) @binding(3) var<storage, read> scales: array<f32>;
//#if MULTI
@group(0) @binding(4) var<uniform> params: StepParams;
//#endif
//#else
//#if MULTI
@group(0) @binding(3) var<uniform> params: StepParams;
//#endif
//#endif

//#include _int8

var<workgroup> red: array<f32, OUTS * SLOTS>;
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
//#if RESCORE
    let n_tokens = wid.y + 1u;  // token row wid.y (a verify step's; its keys say what to keep)
//#else
    let n_tokens = 1u;
//#endif
//#endif
    let t0 = wid.y * TOK;
//#if RESCORE
//#if BOUNDED
    if (t0 >= params.n_tokens) {  // uniform: a row past the step's draft (its keys are not set)
        return;
    }
//#endif
    if (lid == 0u) {
        atomicStore(&n_kept_at, 0u);
//#if !TOPK
        atomicStore(&key_at, 0u);
//#endif
    }
    workgroupBarrier();
//#if TOPK
    let key = keys[t0 * KEY_STRIDE + KEY_SLOTS];  // lm_head_screen_tau.wgsl: the TAU_RANK-th largest key
//#else
    for (var i = lid; i < KEY_SLOTS; i += WG) {
        atomicMax(&key_at, keys[t0 * KEY_STRIDE + i]);
    }
    workgroupBarrier();
    let key = atomicLoad(&key_at);
//#endif
    let tau = from_order_key(key);
    let bounded = key != 0u;  // greedy: 0 = no bound at all (every lower bound NaN) keeps nothing
    for (var i = lid; i < SLICE; i += WG) {
        let row = g * SLICE + i;
        if (row < SHARD_ROWS && START + row < VOCAB) {
//#if TOPK
            if (!bounded || !(upper[t0 * VOCAB + START + row] < tau)) {
                kept[atomicAdd(&n_kept_at, 1u)] = row;
            }
//#if LOGITS
            else {
                logits[t0 * V + START + row] = bitcast<f32>(neg_inf_bits);
            }
//#endif
//#else
            if (bounded && upper[t0 * VOCAB + START + row] >= tau) {
                kept[atomicAdd(&n_kept_at, 1u)] = row;
            }
//#endif
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        n_kept_wg = atomicLoad(&n_kept_at);
    }
    let n_kept = workgroupUniformLoad(&n_kept_wg);
//#if TOPK
//#if !LOGITS
    var base = 0u;  // thread 0: where this workgroup's kept rows go in the candidate list
    if (lid == 0u && n_kept > 0u) {
        base = atomicAdd(&candidates.count, n_kept);
    }
//#endif
//#else
    var best_v = 0.0;
    var best_i = NO_INDEX;
//#endif
    for (var k = 0u; k < n_kept; k += ROWS) {  // ROWS kept rows at a time (the last one repeated)
//#for r in ROWS
    let row{{r}} = kept[min(k + {{r}}u, n_kept - 1u)];
//#endfor
//#else
//#for r in ROWS
    let row{{r}} = min(g * ROWS + {{r}}u, SHARD_ROWS - 1u);
//#endfor
//#endif
//#for it in ITERS
    let c{{it}} = lid + {{it}}u * WG;
//#if WHOLE
    let cc{{it}} = c{{it}};  // D8 = ITERS * WG: every chunk is inside the row
//#else
    let cc{{it}} = min(c{{it}}, D8 - 1u);
//#endif
//#for r in ROWS
    let w{{it}}_{{r}} = table[row{{r}} * D8 + cc{{it}}];
//#endfor
//#endfor
//#for r in ROWS
//#for m in TOK
    var acc{{r}}_{{m}} = 0.0;
//#endfor
//#endfor
//#for it in ITERS
//#if INT8
//#for r in ROWS
    let wa{{it}}_{{r}} = int8x4(w{{it}}_{{r}}.x);
    let wb{{it}}_{{r}} = int8x4(w{{it}}_{{r}}.y);
    let wc{{it}}_{{r}} = int8x4(w{{it}}_{{r}}.z);
    let wd{{it}}_{{r}} = int8x4(w{{it}}_{{r}}.w);
//#endfor
//#for m in TOK
    if (t0 + {{m}}u < n_tokens) {  // uniform: a verify step's rows past its draft cost nothing
        let t = t0 + {{m}}u;
//#if WHOLE
        let xa = x[t * D4 + 4u * cc{{it}}];
        let xb = x[t * D4 + 4u * cc{{it}} + 1u];
        let xc = x[t * D4 + 4u * cc{{it}} + 2u];
        let xd = x[t * D4 + 4u * cc{{it}} + 3u];
//#else
        let inside = c{{it}} < D8;
        let xa = select(vec4<f32>(0.0), x[t * D4 + 4u * cc{{it}}], inside);
        let xb = select(vec4<f32>(0.0), x[t * D4 + 4u * cc{{it}} + 1u], inside);
        let xc = select(vec4<f32>(0.0), x[t * D4 + 4u * cc{{it}} + 2u], inside);
        let xd = select(vec4<f32>(0.0), x[t * D4 + 4u * cc{{it}} + 3u], inside);
//#endif
//#for r in ROWS
        acc{{r}}_{{m}} += dot(wa{{it}}_{{r}}, xa) + dot(wb{{it}}_{{r}}, xb) + dot(wc{{it}}_{{r}}, xc) + dot(wd{{it}}_{{r}}, xd);
//#endfor
    }
//#endfor
//#else
//#for r in ROWS
    let wa{{it}}_{{r}} = vec4<f32>(unpack2x16float(w{{it}}_{{r}}.x), unpack2x16float(w{{it}}_{{r}}.y));
    let wb{{it}}_{{r}} = vec4<f32>(unpack2x16float(w{{it}}_{{r}}.z), unpack2x16float(w{{it}}_{{r}}.w));
//#endfor
//#for m in TOK
    if (t0 + {{m}}u < n_tokens) {
        let t = t0 + {{m}}u;
//#if WHOLE
        let xa = x[t * D4 + 2u * cc{{it}}];
        let xb = x[t * D4 + 2u * cc{{it}} + 1u];
//#else
        let xa = select(vec4<f32>(0.0), x[t * D4 + 2u * cc{{it}}], c{{it}} < D8);
        let xb = select(vec4<f32>(0.0), x[t * D4 + 2u * cc{{it}} + 1u], c{{it}} < D8);
//#endif
//#for r in ROWS
        acc{{r}}_{{m}} += dot(wa{{it}}_{{r}}, xa) + dot(wb{{it}}_{{r}}, xb);
//#endfor
    }
//#endfor
//#endif
//#endfor
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
//#for r in ROWS
//#for m in TOK
    let s{{r}}_{{m}} = subgroupAdd(acc{{r}}_{{m}});
//#endfor
//#endfor
    if (sg_lane == 0u) {
        let slot = lid / sg_size;
//#for r in ROWS
//#for m in TOK
        red[({{r}}u * TOK + {{m}}u) * SLOTS + slot] = s{{r}}_{{m}};
//#endfor
//#endfor
    }
//#else
    let n_slots = WG;
//#for r in ROWS
//#for m in TOK
    red[({{r}}u * TOK + {{m}}u) * SLOTS + lid] = acc{{r}}_{{m}};
//#endfor
//#endfor
//#endif
    workgroupBarrier();
//#if RESCORE
    if (lid == 0u) {
//#for r in ROWS
        {
            var total = 0.0;
            for (var i = 0u; i < n_slots; i++) {  // the one-row head's order
                total += red[{{r}}u * SLOTS + i];
            }
            let row = START + row{{r}};
//#if TOPK
            if (k + {{r}}u < n_kept) {  // the last group's repeated row is written once
//#if LOGITS
                logits[t0 * V + row] = total;
//#else
                candidates.pairs[base + k + {{r}}u] = vec2<u32>(bitcast<u32>(total), row);
//#endif
            }
//#else
            if (total == total && (best_i == NO_INDEX || total > best_v || (total == best_v && row < best_i))) {
                best_v = total;
                best_i = row;
            }
//#endif
        }
//#endfor
    }
    workgroupBarrier();  // red is the next kept row's
    }
//#if !TOPK
    if (lid == 0u) {
        partials[t0 * PART_ROW + PART_BASE + g] = vec2<u32>(bitcast<u32>(best_v), best_i);
    }
//#endif
//#else
    for (var o = lid; o < OUTS; o += WG) {
        let r = o / TOK;
        let t = t0 + o % TOK;
        let row = g * ROWS + r;
        if (row < SHARD_ROWS && t < n_tokens) {
            var total = 0.0;
            for (var i = 0u; i < n_slots; i++) {
                total += red[o * SLOTS + i];
            }
//#if INT8
            total *= scales[START + row];
//#endif
            logits[t * V + START + row] = total;
        }
    }
//#endif
}
