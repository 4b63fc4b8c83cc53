// Speculative decoding, first kernel of a verify step: fold the previous step's emitted tokens into
// the token history, draft the next K tokens by prompt lookup, and set up the verify pass.
//
// The rule is model/speculation.py's prompt_lookup_draft: for n = NGRAM .. 1, the largest i with
// history[i : i+n] == the last n tokens and i + n < L (L = tokens in the history); the first n with a
// match decides and the draft is K tokens copied from i + n on, past the history's end by its own tokens
// (token j = history[i + n + j % (L - i - n)]), as long as the evidence: n tokens after an n-gram
// shorter than NGRAM, K after a full one (draft_length). Every candidate end e = i + n - 1 <= L - 2
// gets c(e) = how many of its trailing tokens (up to NGRAM) equal the history's last ones; then for
// every n the largest e with c(e) >= n is kept (workgroup atomics). The draft starts at e + 1 whatever n.
//
// K = 0 builds a draft-off step: the fold and a one-row step (its row: the last token), no lookup. The
// decode loop mixes such steps with drafting ones on the same buffers (sized for OUT_K drafted tokens)
// without reading anything back between them.
//
// The reply's end: state[3] is the budget, the tokens its steps may still emit (NO_BUDGET: no limit),
// less those folded here, and 0 once a folded token is one of the STOPS stop ids in state[4..]. A
// step that starts with no budget left is over: n_tokens = 0 (every kernel of the step leaves at
// once), no draft, and its acceptance emits nothing (out[0] = 0), so the next step folds nothing.
//
// One workgroup. Writes:
//   token_ids[0..K]  the verify pass's rows: the last token, then the draft (padded with the last
//                    token; padding rows are past n_tokens: the step's kernels skip them)
//   draft[0..K-1]    the drafted tokens (0 past draft_len)
//   state            [0] draft_len  [1] L (the history's length after the fold)
//                    [2] kv_capacity (written by the host)  [3] the budget left
//   step             StepParams (n_tokens = draft_len + 1, pos = L - 1, kv_capacity): the model's uniform, written
//                    here as storage for the step's later dispatches; its slot is the step's index in
//                    the submit, which step_advance.wgsl (VERIFY) advances
//   out[0] = 0       the fold consumed the previous step's tokens
//
// Bindings: 0 history [HISTORY] u32, 1 state [4 + STOPS] u32, 2 out [OUT_K + 2] u32 (n_emitted, tokens...),
//           3 draft [max(OUT_K, 1)] u32, 4 token_ids [>= K + 1] u32, 5 step [4] u32.
// Dispatch: (1, 1, 1).

const K: u32 = ${K};          // tokens this step drafts (0: a draft-off step)
const OUT_K: u32 = ${OUT_K};  // the buffers' draft size: a previous step emitted up to OUT_K + 1 tokens
const NGRAM: u32 = ${NGRAM};
const WG: u32 = ${WG};
const HISTORY: u32 = ${HISTORY};
const STOPS: u32 = ${STOPS};  // stop-id slots in state[4..]
const NO_BUDGET: u32 = 0xffffffffu;

@group(0) @binding(0) var<storage, read_write> history: array<u32>;
@group(0) @binding(1) var<storage, read_write> state: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
@group(0) @binding(3) var<storage, read_write> draft: array<u32>;
@group(0) @binding(4) var<storage, read_write> token_ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> step: array<u32>;

var<workgroup> best: array<atomic<u32>, NGRAM>;  // per n: 1 + the largest matching end e, 0 = none
var<workgroup> header: vec3<u32>;                 // (n_emitted, L before the fold, budget), read once
var<workgroup> stopped: atomic<u32>;              // a folded token is a stop id

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        header = vec3<u32>(min(out[0], OUT_K + 1u), state[1], state[3]);
        atomicStore(&stopped, 0u);
    }
    if (lid < NGRAM) {
        atomicStore(&best[lid], 0u);
    }
    let head = workgroupUniformLoad(&header);
    let n_new = head.x;
    let length = min(head.y + n_new, HISTORY);
    if (lid < n_new) {
        let token = out[1u + lid];
        if (head.y + lid < HISTORY) {
            history[head.y + lid] = token;
        }
        for (var i = 0u; i < STOPS; i++) {
            if (state[4u + i] == token) {
                atomicOr(&stopped, 1u);
            }
        }
    }
    storageBarrier();
    workgroupBarrier();
    var budget = head.z;
    if (budget != NO_BUDGET) {
        budget -= min(n_new, budget);
    }
    if (atomicLoad(&stopped) != 0u) {
        budget = 0u;
    }
    let live = budget != 0u;

    for (var e = lid; K > 0u && live && e + 1u < length; e += WG) {
        var c = 0u;
        for (var t = 0u; t < NGRAM; t++) {
            if (t > e || history[e - t] != history[length - 1u - t]) {
                break;
            }
            c += 1u;
        }
        for (var n = 1u; n <= c; n++) {
            atomicMax(&best[n - 1u], e + 1u);
        }
    }
    workgroupBarrier();

    var found = 0u;  // 1 + e of the deciding n-gram, 0 = no draft
    var matched = 0u;  // its length n
    for (var n = NGRAM; n > 0u; n--) {
        let b = atomicLoad(&best[n - 1u]);
        if (b != 0u) {
            found = b;
            matched = n;
            break;
        }
    }
    let last = history[length - 1u];
    // start e + 1 = found; as many tokens as the match is long, K after a full NGRAM match
    let draft_len = select(0u, select(min(matched, K), K, matched == NGRAM), found != 0u && live);
    let period = max(length - found, 1u);         // the copy's period (found <= length - 1)
    if (lid <= K) {
        let j = lid;
        var row = last;
        if (j > 0u && j - 1u < draft_len) {
            row = history[found + (j - 1u) % period];
        }
        token_ids[j] = row;
        if (j < K) {
            draft[j] = select(0u, history[found + j % period], j < draft_len);
        }
    }
    storageBarrier();
    workgroupBarrier();  // every thread has read out[] and state[] before thread 0 writes them
    if (lid == 0u) {
        state[0] = draft_len;
        state[1] = length;
        state[3] = budget;
        step[0] = select(0u, draft_len + 1u, live);  // the step's dispatches cover K + 1 rows; those past this exit
        step[1] = length - 1u;
        step[2] = state[2];
        out[0] = 0u;
    }
}
