// Greedy sampling on the GPU: the index of the largest logit, written where the next step reads it.
//
//   out_ids[SLOT] = argmax_v logits[ROW * V + v]      ties -> the smallest index (like np.argmax)
//
// NaN logits never win. Keeping the id on the GPU lets step n+1 be recorded and queued before
// step n's result is read back.
//
// Bindings:
//   0 logits   [rows, V] f32
//   1 out_ids  [>= SLOT + 1] u32
//
// Mapping: one workgroup of WG threads; thread lid scans v = lid, lid + WG, ... (coalesced), then
// (value, index) pairs reduce by subgroupMax / subgroupMin into one slot per subgroup, or by a
// workgroup-memory tree without subgroups. Dispatch: (1, 1, 1).

const V: u32 = ${V};
const ROW: u32 = ${ROW};
const SLOT: u32 = ${SLOT};
const WG: u32 = ${WG};
const ITERS: u32 = (V + WG - 1u) / WG;
const NO_INDEX: u32 = 0xffffffffu;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> out_ids: array<u32>;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;
var<workgroup> n_slots_wg: u32;

// Does (va, ia) beat (vb, ib)? Larger value, then smaller index; NO_INDEX never wins.
fn better(va: f32, ia: u32, vb: f32, ib: u32) -> bool {
    return ib == NO_INDEX || (ia != NO_INDEX && (va > vb || (va == vb && ia < ib)));
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    var bv = 0.0;
    var bi = NO_INDEX;
    for (var it = 0u; it < ITERS; it++) {
        let v = lid + it * WG;
        if (v < V) {
            let value = logits[ROW * V + v];
            // value == value is false for NaN; scanning upwards keeps the first of equal values
            if (value == value && (bi == NO_INDEX || value > bv)) {
                bv = value;
                bi = v;
            }
        }
    }
//#if SUBGROUPS
    if (lid == 0u) {
        n_slots_wg = (WG + sg_size - 1u) / sg_size;
    }
    let n_slots = workgroupUniformLoad(&n_slots_wg);
    let has = bi != NO_INDEX;
    let m = subgroupMax(select(-3.402823e38, bv, has));
    let mi = subgroupMin(select(NO_INDEX, bi, has && bv == m));
    if (sg_lane == 0u) {
        best_v[lid / sg_size] = m;
        best_i[lid / sg_size] = mi;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var v = best_v[0];
        var i = best_i[0];
        for (var s = 1u; s < n_slots; s++) {
            if (better(best_v[s], best_i[s], v, i)) {
                v = best_v[s];
                i = best_i[s];
            }
        }
        out_ids[SLOT] = select(i, 0u, i == NO_INDEX);
    }
//#else
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride && better(best_v[lid + stride], best_i[lid + stride], best_v[lid], best_i[lid])) {
            best_v[lid] = best_v[lid + stride];
            best_i[lid] = best_i[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out_ids[SLOT] = select(best_i[0], 0u, best_i[0] == NO_INDEX);
    }
//#endif
}
