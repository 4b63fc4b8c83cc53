// RoPE + KV-cache append for one layer.
//
// Reads the fused Q/K/V projection of this step's tokens, rotates q and k by their absolute
// positions and writes:  q -> q_out,  rotated k -> k_cache row (pos + t),  v -> v_cache row (pos + t).
//
// Rotation pairs (i < ROPE_DIM / 2, angle = position * inv_freq[i], from the cos/sin table):
//   NEOX (rotate-half, HF `rotate_half`):   (i, i + ROPE_DIM / 2)
//   interleaved (GPT-J, llama.cpp "norm"):  (2i, 2i + 1)
//   y_a = x_a * cos - x_b * sin,   y_b = x_b * cos + x_a * sin
// Dims ROPE_DIM..HD-1 (partial rotary) pass through unrotated.
//
// Bindings:
//   0 params   uniform StepParams           n_tokens, pos (absolute position of row 0), kv_capacity
//   1 qkv      [T, (HQ + 2*HKV) * HD] f32   q heads, then k heads, then v heads (fused projection rows)
//   2 table    [n_positions, ROPE_DIM/2] vec2<f32>  (cos, sin) of position * inv_freq[i]
//   3 q_out    [T, HQ * HD] f32 (vec4)      rotated queries
//   4 k_cache  [capacity, HKV * HD] KVWord  rotated keys, token-major (_kv.wgsl: 4 values per word)
//   5 v_cache  [capacity, HKV * HD] KVWord  values, token-major
//
// Mapping: one invocation per 4 consecutive dims (one cache word) of one head of one token; each
// output dim reads its own value and its rotation partner. Needs HD % 4 == 0.
// Dispatch: (ceil((HQ + 2*HKV) * HD / 4 / WG), n_tokens, 1).

${STEP_PARAMS}
//#include _kv

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const ROPE_DIM: u32 = ${ROPE_DIM};
const NEOX: bool = ${NEOX};
const WG: u32 = ${WG};

const HALF_ROPE: u32 = ROPE_DIM / 2u;
const C4: u32 = HD / 4u;
const QKV_ROW: u32 = (HQ + 2u * HKV) * HD;
const KV_ROW4: u32 = HKV * C4;
const QUADS: u32 = (HQ + 2u * HKV) * C4;

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> q_out: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<KVWord>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<KVWord>;

// Dim d of the head starting at qkv[src], rotated for `position` (dims past ROPE_DIM unchanged).
fn rotated(src: u32, d: u32, position: u32) -> f32 {
    let x = qkv[src + d];
    if (d >= ROPE_DIM) {
        return x;
    }
    var i: u32;        // frequency index
    var partner: u32;  // the other dim of the pair
    var first: bool;   // d is the pair's a (y_a = x_a cos - x_b sin), else its b
    if (NEOX) {
        first = d < HALF_ROPE;
        i = select(d - HALF_ROPE, d, first);
        partner = select(d - HALF_ROPE, d + HALF_ROPE, first);
    } else {
        first = d % 2u == 0u;
        i = d / 2u;
        partner = d ^ 1u;
    }
    let cs = table[position * HALF_ROPE + i];
    let x_p = qkv[src + partner];
    return select(x * cs.x + x_p * cs.y, x * cs.x - x_p * cs.y, first);
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= QUADS || t >= params.n_tokens) {
        return;
    }
    let head = i / C4;
    let c = i % C4;
    let position = params.pos + t;
    let src = t * QKV_ROW + head * HD;
    let d = 4u * c;

    var y: vec4<f32>;
    if (head < HQ + HKV) {
        y = vec4<f32>(rotated(src, d, position), rotated(src, d + 1u, position),
                      rotated(src, d + 2u, position), rotated(src, d + 3u, position));
    } else {
        y = vec4<f32>(qkv[src + d], qkv[src + d + 1u], qkv[src + d + 2u], qkv[src + d + 3u]);
    }

    if (head < HQ) {
        q_out[t * (HQ * C4) + head * C4 + c] = y;
        return;
    }
    // A row past the allocated cache would be clamped onto another row by robust buffer access:
    // drop it instead (the host grows the cache before the step, so this only guards bugs).
    if (position >= params.kv_capacity) {
        return;
    }
    if (head < HQ + HKV) {
        k_cache[position * KV_ROW4 + (head - HQ) * C4 + c] = kv_pack(y);
    } else {
        v_cache[position * KV_ROW4 + (head - HQ - HKV) * C4 + c] = kv_pack(y);
    }
}
