// Speculative decoding, last kernel of a greedy verify step: how much of the draft greedy decoding
// would have produced (model/speculation.py's accept_greedy).
//
//   chosen[j] = argmax of verify row j (row 0: the last accepted token, row j > 0: draft[j-1])
//   accepted  = leading j with draft[j] == chosen[j], j < draft_len
//   out       = [accepted + 1, draft[0..accepted-1], chosen[accepted]]
//
// The next step's spec_draft.wgsl folds `out` into the history. A step past the reply's end (budget
// state[3] = 0, see spec_draft.wgsl) emits nothing: out[0] = 0. One invocation: K + 1 comparisons.
// Bindings: 0 chosen [K + 1] u32, 1 draft [max(K, 1)] u32, 2 state u32 (word 0 draft_len, 3 budget),
//           3 out [K + 2] u32. Dispatch: (1, 1, 1).

const K: u32 = ${K};

@group(0) @binding(0) var<storage, read> chosen: array<u32>;
@group(0) @binding(1) var<storage, read> draft: array<u32>;
@group(0) @binding(2) var<storage, read> state: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(1)
fn main() {
    if (state[3] == 0u) {
        out[0] = 0u;
        return;
    }
    let draft_len = min(state[0], K);
    var accepted = 0u;
    for (var j = 0u; j < draft_len; j++) {
        if (draft[j] != chosen[j]) {
            break;
        }
        out[1u + j] = draft[j];
        accepted += 1u;
    }
    out[1u + accepted] = chosen[accepted];
    out[0] = accepted + 1u;
}
