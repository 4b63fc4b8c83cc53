// Greedy sampling on the GPU: the index of the largest logit, written where the next step reads it.
//
//   out_ids[SLOT] = argmax_v logits[ROW * V + v]      ties -> the smallest index (like np.argmax)
//
// NaN logits never win. Keeping the id on the GPU lets step n+1 be recorded and queued before
// step n's result is read back.
//
// Two passes, two variants of this file (a single workgroup scanning 128256 logits took ~200 us):
//   default:   workgroup g scans logits g*SPAN .. g*SPAN+SPAN-1 (PER loads per thread, all issued
//              first, coalesced) and writes its best (value bits, index) to partials[g].
//   COMBINE:   one workgroup reduces the GROUPS partials and writes out_ids[SLOT].
// Both reduce (value, index) pairs by subgroupMax / subgroupMin into one slot per subgroup, or by
// a workgroup-memory tree without subgroups (WG a power of two).
//
// Bindings:  default: 0 logits    [rows, V] f32
//                     1 partials  [GROUPS] vec2<u32>   (bitcast value, index; index NO_INDEX = none)
//            COMBINE: 0 partials  [GROUPS] vec2<u32>
//                     1 out_ids   [>= SLOT + 1] u32
//
// SCREENED (COMBINE only): the partials are GROUPS rescoring workgroups' of the screened head
// (lm_head.wgsl RESCORE), and the combine also clears its row's KEY_SLOTS keys (binding 2) for the
// next step's screen (lm_head_screen.wgsl).
//
// Dispatch: default (GROUPS, 1, 1) with GROUPS = ceil(V / SPAN), SPAN = WG * PER; then COMBINE (1, 1, 1).
// Several rows at once (speculative verify steps): default (GROUPS, R, 1) scans rows ROW .. ROW + R - 1
// into partials[r * GROUPS + g]; COMBINE (R, 1, 1) writes out_ids[SLOT + r].

const V: u32 = ${V};
const ROW: u32 = ${ROW};
const SLOT: u32 = ${SLOT};
const WG: u32 = ${WG};
const PER: u32 = ${PER};
const SPAN: u32 = WG * PER;
//#if SCREENED
const GROUPS: u32 = ${GROUPS};
const KEY_SLOTS: u32 = ${KEY_SLOTS};
//#else
const GROUPS: u32 = (V + SPAN - 1u) / SPAN;
//#endif
const COMBINE_ITERS: u32 = (GROUPS + WG - 1u) / WG;
const NO_INDEX: u32 = 0xffffffffu;

//#if COMBINE
@group(0) @binding(0) var<storage, read> partials: array<vec2<u32>>;
@group(0) @binding(1) var<storage, read_write> out_ids: array<u32>;
//#if SCREENED
@group(0) @binding(2) var<storage, read_write> keys: array<u32>;
//#endif
//#else
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> partials: array<vec2<u32>>;
//#endif

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;
var<workgroup> n_slots_wg: u32;

// Does (va, ia) beat (vb, ib)? Larger value, then smaller index; NO_INDEX never wins.
fn better(va: f32, ia: u32, vb: f32, ib: u32) -> bool {
    return ib == NO_INDEX || (ia != NO_INDEX && (va > vb || (va == vb && ia < ib)));
}

// The workgroup's best pair (valid in thread 0 at least).
fn reduce_best(bv: f32, bi: u32, lid: u32, sg_size: u32, sg_lane: u32) -> vec2<u32> {
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
    var v = best_v[0];
    var i = best_i[0];
    for (var s = 1u; s < n_slots; s++) {
        if (better(best_v[s], best_i[s], v, i)) {
            v = best_v[s];
            i = best_i[s];
        }
    }
    return vec2<u32>(bitcast<u32>(v), i);
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
    return vec2<u32>(bitcast<u32>(best_v[0]), best_i[0]);
//#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
//#if !SUBGROUPS
    let sg_size = 1u;
    let sg_lane = 0u;
//#endif
//#if !COMBINE
    let base = wid.x * SPAN + lid;
    let row = ROW + wid.y;
//#for i in PER
    let val{{i}} = logits[row * V + min(base + {{i}}u * WG, V - 1u)];  // all loads first (clamped)
//#endfor
    var bv = 0.0;
    var bi = NO_INDEX;
//#for i in PER
    // value == value is false for NaN; scanning upwards keeps the first of equal values
    if (base + {{i}}u * WG < V && val{{i}} == val{{i}} && (bi == NO_INDEX || val{{i}} > bv)) {
        bv = val{{i}};
        bi = base + {{i}}u * WG;
    }
//#endfor
    let best = reduce_best(bv, bi, lid, sg_size, sg_lane);
    if (lid == 0u) {
        partials[wid.y * GROUPS + wid.x] = best;
    }
//#else
    var bv = 0.0;
    var bi = NO_INDEX;
    for (var it = 0u; it < COMBINE_ITERS; it++) {  // partials in index order: ties keep the first
        let g = lid + it * WG;
        if (g < GROUPS) {
            let p = partials[wid.x * GROUPS + g];
            if (better(bitcast<f32>(p.x), p.y, bv, bi)) {
                bv = bitcast<f32>(p.x);
                bi = p.y;
            }
        }
    }
    let best = reduce_best(bv, bi, lid, sg_size, sg_lane);
    if (lid == 0u) {
        out_ids[SLOT + wid.x] = select(best.y, 0u, best.y == NO_INDEX);
    }
//#if SCREENED
    for (var i = lid; i < KEY_SLOTS; i += WG) {
        keys[wid.x * KEY_SLOTS + i] = 0u;
    }
//#endif
//#endif
}
