// Speculative sampling on the GPU: for a verify pass over [last token, draft_0 .. draft_{k-1}], decide
// which drafted tokens are kept and draw the next one, so sampled speculative steps queue without a
// readback. The rule is model/speculation.py `accept_sampled` (a drafted token x is kept with
// probability p(x), else a token is drawn from p with x removed): the emitted text is distributed
// exactly as plain sampling's. p is the GPU sampler's distribution (sample_topk.wgsl: repetition
// penalty, top-k, top-p, min-p, temperature), row by row.
//
// Randomness: row r uses draws counter + 2r (accept or not) and counter + 2r + 1 (the token drawn
// at the first rejected row, from the residual in token-id order, or from p at row draft_len when
// every drafted token was kept, in the sampler's order); the counter then goes up by 2 * emitted.
//
// Variants (rows: workgroup_id.y, dispatched for n_rows = k + 1 rows; rows past draft_len idle):
//   PENALTY: workgroup r penalizes row r in place for the last `window` tokens of the ring followed
//            by draft_0 .. draft_{r-1} (the tokens before that position)
//   SPANS:   spans of N logits of each row -> best K pairs (as sample_topk.wgsl, per row)
//   MERGE:   groups of a previous level's lists of each row -> best K (SPANS and MERGE: LEVEL)
//   FINAL:   one workgroup per row: sort its last <= N pairs, decide that row (see above)
//   FINAL CANDIDATES: a draft-off step's one row after an int8 screen (kernels/head_screen.py): the
//            best K of the screen's candidate list (_candidate_sort), decided as FINAL's row 0
//   ACCEPT:  one thread: walk the rows' decisions, emit, advance the counter, append to the ring
//
// Bindings:  PENALTY: 0 logits (read_write) [rows, V], 1 params, 2 ring (read), 3 draft, 4 spec
//            SPANS:   0 logits [rows, V], 1 lists_out [rows, GROUPS * K] vec2<u32>
//            MERGE:   0 lists_in [rows, N_IN], 1 lists_out [rows, GROUPS * K]
//            FINAL:   0 lists_in [rows, N_IN], 1 params, 2 ring (read), 3 draft, 4 spec, 5 decisions
//            FINAL CANDIDATES: 0 candidates, 1 params, 2 ring (read), 3 spec, 4 decisions, 5 keys
//            ACCEPT:  0 decisions (read), 1 params, 2 ring (read_write), 3 out
// ring:      sample_topk.wgsl's state ([0] draw counter, [1] status, [2] ring length, [3] ring head,
//            [4 ..] the ring of RING_MAX), then [4 + RING_MAX] drafted tokens proposed and
//            [5 + RING_MAX] accepted, summed over the steps since configure
// draft:     [k] u32 drafted tokens; spec: [0] draft_len (clamped to n_rows - 1), [3] budget (0: the
//            step is past the reply's end, spec_draft.wgsl)
// decisions: [0] draft_len (OVER past the reply's end: ACCEPT emits nothing), then per row r: [1 + 2r] flags (1 = drafted token kept, 2 = no valid
//            logit: token 0), [2 + 2r] the token
// out:       [0] tokens emitted (kept drafted tokens + 1), [1 ..] the tokens

//#include _topk_sort

const OVER: u32 = 0xffffffffu;

//#if PENALTY
const V: u32 = ${V};
@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read> ring: array<u32>;
@group(0) @binding(3) var<storage, read> draft: array<u32>;
@group(0) @binding(4) var<storage, read> spec: array<u32>;
//#endif
//#if FINAL
//#if CANDIDATES
//#include _candidates
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const RING_MAX: u32 = ${RING_MAX};
@group(0) @binding(0) var<storage, read_write> candidates: Candidates;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read> state: array<u32>;
@group(0) @binding(3) var<storage, read> spec: array<u32>;
@group(0) @binding(4) var<storage, read_write> decisions: array<u32>;
@group(0) @binding(5) var<storage, read_write> keys: array<u32>;
//#include _candidate_sort
//#else
const N_IN: u32 = ${N_IN};
@group(0) @binding(0) var<storage, read> lists_in: array<vec2<u32>>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read> ring: array<u32>;
@group(0) @binding(3) var<storage, read> draft: array<u32>;
@group(0) @binding(4) var<storage, read> spec: array<u32>;
@group(0) @binding(5) var<storage, read_write> decisions: array<u32>;
//#endif
//#endif
//#if ACCEPT
const RING_MAX: u32 = ${RING_MAX};
@group(0) @binding(0) var<storage, read> decisions: array<u32>;
@group(0) @binding(1) var<uniform> params: SampleParams;
@group(0) @binding(2) var<storage, read_write> ring: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
//#endif
//#if MERGE
const N_IN: u32 = ${N_IN};
@group(0) @binding(0) var<storage, read> lists_in: array<vec2<u32>>;
//#endif
//#if SPANS
const V: u32 = ${V};
@group(0) @binding(0) var<storage, read> logits: array<f32>;
//#endif
//#if LEVEL
const GROUPS: u32 = ${GROUPS};
@group(0) @binding(1) var<storage, read_write> lists_out: array<vec2<u32>>;
//#endif

//#if PENALTY
// Token e of [ring oldest .. newest, draft_0 ..] (the ring holds `length` tokens, head = next write).
fn recent_token(e: u32, length: u32, head: u32) -> u32 {
    if (e < length) {
        return ring[RING_AT + (head + params.window - length + e) % params.window];
    }
    return draft[e - length];
}

// llama.cpp's repetition penalty, as sample_topk.wgsl's PENALTY: thread t takes entry t of the
// row's window and skips it when an earlier entry holds the same token.
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let length = min(ring[2], params.window);
    let head = ring[3];
    let total = length + row;
    let n = min(total, params.window);
    if (lid >= n || row > spec[0]) {
        return;
    }
    let first = total - n;
    let token = recent_token(first + lid, length, head);
    for (var t = 0u; t < lid; t++) {
        if (recent_token(first + t, length, head) == token) {
            return;
        }
    }
    if (token < V) {
        let at = row * V + token;
        let value = logits[at];
        logits[at] = select(value * params.penalty, value / params.penalty, value > 0.0);
    }
}
//#endif

//#if FINAL
//#if CANDIDATES
// A draft-off step's row through the screen: the same decision as FINAL's for row 0 of a one-row
// step (draft_len 0: a token drawn from p with draw counter + 1), from the candidate list; then the
// list is emptied and the screen's keys zeroed.
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    sort_candidates(lid);
    let top = candidate_weights(lid);
    release_screen(lid);
    if (lid != 0u) {
        return;
    }
    let n_cand = count_candidates();
    var flags = 2u;  // no valid logit: token 0
    var token = 0u;
    if (n_cand > 0u && top > 3.402823e38) {  // +inf: one-hot on the first +inf (CPU: argmax)
        flags = 0u;
        token = sort_pairs[0].y;
    } else if (n_cand > 0u) {
        flags = 0u;
        let u = uniform_draw(params.seed_lo, params.seed_hi, state[0] + 1u);
        token = sort_pairs[inverse_cdf(keep_count(n_cand), u)].y;
    }
    decisions[1] = flags;
    decisions[2] = token;
    decisions[0] = select(0u, OVER, spec[3] == 0u);  // no budget: past the reply's end
}
//#else
var<workgroup> kept: u32;
var<workgroup> residual_pick: atomic<u32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.y;
    load_and_sort(lid, 0u, row);
    let top = candidate_weights(lid);
    let draft_len = min(spec[0], groups.y - 1u);
    let drafted = select(NO_INDEX, draft[min(row, draft_len)], row < draft_len);
    if (lid == 0u) {
        let n_cand = count_candidates();
        var keep = 0u;  // no valid logit
        if (n_cand > 0u && top > 3.402823e38) {  // +inf: one-hot on the first +inf (CPU: argmax)
            keep = 1u;
            weight_t[0] = 1.0;
        } else if (n_cand > 0u) {
            keep = keep_count(n_cand);
        }
        kept = keep;
        atomicStore(&residual_pick, 0u);
    }
    workgroupBarrier();
    // Every thread sums the kept weights (same order, same result); thread c also the residual
    // weight of the kept tokens with smaller ids than its candidate: the residual's CDF in id order.
    let keep = kept;
    let mine = select(NO_INDEX, sort_pairs[min(lid, N - 1u)].y, lid < keep);
    var mass = 0.0;
    var drafted_mass = 0.0;
    var below = 0.0;
    for (var i = 0u; i < keep; i++) {
        let w = weight_t[i];
        let id = sort_pairs[i].y;
        mass += w;
        if (id == drafted) {
            drafted_mass += w;
        } else if (id < mine) {
            below += w;
        }
    }
    let residual = mass - drafted_mass;
    let seed_lo = params.seed_lo;
    let seed_hi = params.seed_hi;
    let draw = ring[0] + 2u * row;
    let target_weight = uniform_draw(seed_lo, seed_hi, draw + 1u) * residual;
    if (row < draft_len && mine != NO_INDEX && mine != drafted && below <= target_weight) {
        atomicMax(&residual_pick, mine);  // the last id whose residual CDF starts at or below the draw
    }
    workgroupBarrier();
    if (lid != 0u || row > draft_len) {
        return;
    }
    var flags = 0u;
    var token = 0u;
    if (keep == 0u) {
        flags = 2u;
    } else if (row == draft_len) {
        token = sort_pairs[inverse_cdf(keep, uniform_draw(seed_lo, seed_hi, draw + 1u))].y;
    } else if (uniform_draw(seed_lo, seed_hi, draw) * mass < drafted_mass || residual <= 0.0) {
        flags = 1u;
        token = drafted;
    } else {
        token = atomicLoad(&residual_pick);
    }
    decisions[1u + 2u * row] = flags;
    decisions[2u + 2u * row] = token;
    if (row == 0u) {
        decisions[0] = select(draft_len, OVER, spec[3] == 0u);  // no budget: past the reply's end
    }
}
//#endif
//#endif

//#if ACCEPT
@compute @workgroup_size(1)
fn main() {
    let draft_len = decisions[0];
    if (draft_len == OVER) {  // past the reply's end: nothing emitted, no draw taken
        out[0] = 0u;
        return;
    }
    var emitted = 0u;
    var status = 0u;
    for (var row = 0u; row <= draft_len; row++) {
        let flags = decisions[1u + 2u * row];
        let token = decisions[2u + 2u * row];
        emitted += 1u;
        out[emitted] = token;
        status |= flags >> 1u;
        if (params.window > 0u) {  // the ring the next step's penalty reads: exactly the emitted tokens
            let head = ring[3];
            ring[RING_AT + head] = token;
            ring[3] = (head + 1u) % params.window;
            ring[2] = min(ring[2] + 1u, params.window);
        }
        if ((flags & 1u) == 0u) {
            break;
        }
    }
    out[0] = emitted;
    ring[0] += 2u * emitted;
    ring[1] = status;
    ring[RING_AT + RING_MAX] += draft_len;
    ring[RING_AT + RING_MAX + 1u] += emitted - 1u;
}
//#endif

//#if LEVEL
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    load_and_sort(lid, wid.x, wid.y);
    if (lid < K) {
        lists_out[(wid.y * GROUPS + wid.x) * K + lid] = sort_pairs[lid];
    }
}
//#endif
