// Merge the per-tile partials of split-sequence attention (attention.wgsl with SPLIT = true).
//
// For token t and query head qh, with n partials (acc_s, m_s, l_s) (n_tiles = ceil((pos + t + 1) / TILE)
// dealt ceil(n_tiles / n_splits) per partial, n_splits = split_count of _split_plan.wgsl, as attention.wgsl
// deals them):
//   M = max_s m_s,  w_s = exp(m_s - M),  out = sum_s w_s * acc_s / sum_s w_s * l_s
//
// Bindings:
//   0 params  uniform StepParams
//   1 part    [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32 (vec4)   unnormalized partial outputs
//   2 stats   [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>         (m, l) of each partial
//   3 out     [T, HQ * HD] f32 (vec4)
//
// Mapping: one workgroup per (query head, token). Invocation i first loads vec4 column i % C4 of
// partials s = i / C4 + k * SLICES (k < 8; the latency overlaps what follows); invocation s < n
// loads partial s's (m, l); M by a tree over MAX_SPLITS entries; invocation s stores w_s; each
// invocation weighs its partials, and the SLICES sums of each column are added in workgroup memory.
// Needs MAX_SPLITS <= WG. A token with one split has nothing to merge: its attention workgroup wrote
// the output, and this workgroup leaves at once.
// Dispatch: (HQ, n_tokens, 1).

${STEP_PARAMS}

const HQ: u32 = ${HQ};
const HD: u32 = ${HD};
const TILE: u32 = ${TILE};
const WG: u32 = ${WG};
const MAX_SPLITS: u32 = ${MAX_SPLITS};
const SPLIT_CAP: u32 = ${SPLIT_CAP};
const DIRECT_TILES: u32 = ${DIRECT_TILES};

const C4: u32 = HD / 4u;
const SLICES: u32 = WG / C4;
//#include _split_plan

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> red: array<f32, MAX_SPLITS>;
var<workgroup> weight: array<f32, MAX_SPLITS>;      // w_s, 0 past the last partial
var<workgroup> weighted_l: array<f32, MAX_SPLITS>;  // w_s * l_s
var<workgroup> slice_acc: array<vec4<f32>, WG>;
var<workgroup> slice_l: array<f32, WG>;

struct Parts8 {
    p0: vec4<f32>, p1: vec4<f32>, p2: vec4<f32>, p3: vec4<f32>,
    p4: vec4<f32>, p5: vec4<f32>, p6: vec4<f32>, p7: vec4<f32>,
};

// Column col of partials s, s + SLICES, ..., s + 7 * SLICES (indices past the last one re-read it).
fn load8(first: u32, s: u32, n_parts: u32, col: u32) -> Parts8 {
    let last = n_parts - 1u;
    return Parts8(
        part[(first + min(s, last)) * C4 + col],
        part[(first + min(s + SLICES, last)) * C4 + col],
        part[(first + min(s + 2u * SLICES, last)) * C4 + col],
        part[(first + min(s + 3u * SLICES, last)) * C4 + col],
        part[(first + min(s + 4u * SLICES, last)) * C4 + col],
        part[(first + min(s + 5u * SLICES, last)) * C4 + col],
        part[(first + min(s + 6u * SLICES, last)) * C4 + col],
        part[(first + min(s + 7u * SLICES, last)) * C4 + col]);
}

// w_s, zero past the partials (weight[] holds zeros from n_parts to MAX_SPLITS).
fn w(s: u32) -> f32 {
    return select(0.0, weight[min(s, MAX_SPLITS - 1u)], s < MAX_SPLITS);
}

fn wl(s: u32) -> f32 {
    return select(0.0, weighted_l[min(s, MAX_SPLITS - 1u)], s < MAX_SPLITS);
}

fn weigh8(p: Parts8, s: u32) -> vec4<f32> {
    return w(s) * p.p0 + w(s + SLICES) * p.p1 + w(s + 2u * SLICES) * p.p2 + w(s + 3u * SLICES) * p.p3
         + w(s + 4u * SLICES) * p.p4 + w(s + 5u * SLICES) * p.p5 + w(s + 6u * SLICES) * p.p6
         + w(s + 7u * SLICES) * p.p7;
}

fn weighted_l8(s: u32) -> f32 {
    return wl(s) + wl(s + SLICES) + wl(s + 2u * SLICES) + wl(s + 3u * SLICES) + wl(s + 4u * SLICES)
         + wl(s + 5u * SLICES) + wl(s + 6u * SLICES) + wl(s + 7u * SLICES);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let qh = wid.x;
    let t = wid.y;
    if (t >= params.n_tokens) {
        return;
    }
    let n_tiles = (params.pos + t + TILE) / TILE;
    let n_splits = split_count(params.pos + t + 1u, n_tiles);
    if (n_splits == 1u) {
        return;  // one split: attention.wgsl wrote this token's output itself (direct_out)
    }
    let per_split = (n_tiles + n_splits - 1u) / n_splits;
    let n_parts = (n_tiles + per_split - 1u) / per_split;
    let first = (t * HQ + qh) * MAX_SPLITS;

    // This invocation's first 8 partials (column col, s = slice, slice + SLICES, ...) are loaded
    // before the max is known, so their latency overlaps the stats reduction.
    let col = tid % C4;
    let slice = tid / C4;
    let parts = load8(first, slice, n_parts, col);

    var st = vec2<f32>(-3.0e38, 0.0);
    if (tid < n_parts) {
        st = stats[first + tid];
    }
    if (tid < MAX_SPLITS) {
        red[tid] = st.x;
    }
    workgroupBarrier();
    for (var stride = MAX_SPLITS / 2u; stride > 0u; stride = stride / 2u) {
        if (tid < stride) {
            red[tid] = max(red[tid], red[tid + stride]);
        }
        workgroupBarrier();
    }
    if (tid < MAX_SPLITS) {
        let ws = select(0.0, exp(st.x - red[0]), tid < n_parts);
        weight[tid] = ws;
        weighted_l[tid] = ws * st.y;
    }
    workgroupBarrier();

    var acc = vec4<f32>(0.0);
    var l = 0.0;
    for (var s = slice + 8u * SLICES; s < n_parts; s += 8u * SLICES) {
        let more = load8(first, s, n_parts, col);
        acc += weigh8(more, s);
        l += weighted_l8(s);
    }
    acc += weigh8(parts, slice);
    l += weighted_l8(slice);
    slice_acc[tid] = acc;
    slice_l[tid] = l;
    workgroupBarrier();
    if (tid < C4) {
        for (var k = 1u; k < SLICES; k++) {
            acc += slice_acc[k * C4 + tid];
            l += slice_l[k * C4 + tid];
        }
        out[t * (HQ * C4) + qh * C4 + tid] = acc / l;
    }
}
