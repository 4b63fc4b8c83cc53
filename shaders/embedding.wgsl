// Token embedding lookup from one row shard of an F16 table.
//
//   x[t, :] = f32(table[ids[t], :])     for ids[t] in [START, STOP)
//
// The table is split by rows into shards that each fit one storage binding; one dispatch per
// shard, each writing only the tokens whose id falls in its rows. The first shard also writes
// zeros for ids >= V, so an invalid id never leaves a stale row behind.
//
// Bindings:
//   0 ids    [T] u32                  token ids (a GPU argmax may have written them)
//   1 table  [STOP - START, D/4] vec2<u32>   F16 rows, 4 halves per vec2<u32>
//   2 x      [T, D/4] vec4<f32>       output rows
//
// Mapping: one invocation per 4 values of a row. Dispatch: (ceil(D/4 / WG), n_tokens, 1).

const D4: u32 = ${D4};
const START: u32 = ${START};
const STOP: u32 = ${STOP};
const V: u32 = ${V};
const FIRST_SHARD: bool = ${FIRST_SHARD};
const WG: u32 = ${WG};

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> table: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> x: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= D4) {
        return;
    }
    let id = ids[t];
    if (id >= START && id < STOP) {
        let h = table[(id - START) * D4 + c];
        x[t * D4 + c] = vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
    } else if (FIRST_SHARD && id >= V) {
        x[t * D4 + c] = vec4<f32>(0.0);
    }
}
