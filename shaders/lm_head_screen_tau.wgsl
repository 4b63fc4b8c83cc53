// The bound of a sampled step's screened candidates (kernels/head_screen.py): after lm_head_screen.wgsl
// spread its workgroups' best lower bounds over KEY_SLOTS order keys (each a different row's), one
// workgroup finds their TAU_RANK-th largest (_radix_select, two rounds: the low 16 bits cleared, a
// lower bound of it) and writes it to keys[KEY_SLOTS], where every workgroup of lm_head.wgsl RESCORE
// TOPK reads it: at least TAU_RANK rows have a lower bound at or above it.
//
// Token rows (a verify step's, workgroup r for row r): row r's keys start at r * KEY_STRIDE. CLEAR: the
// workgroup then zeroes its row's KEY_SLOTS keys for the next step's screen (nothing reads them after
// the tau; a decode step's draw clears them instead).
//
// Bindings: 0 keys [rows, KEY_STRIDE >= KEY_SLOTS + 1] u32. Dispatch (rows, 1, 1), WG threads.

const WG: u32 = ${WG};
const KEY_SLOTS: u32 = ${KEY_SLOTS};
const KEY_STRIDE: u32 = ${KEY_STRIDE};
const TAU_RANK: u32 = ${TAU_RANK};

@group(0) @binding(0) var<storage, read_write> keys: array<u32>;

var<private> key_base: u32;

//#include _radix_select

fn radix_key(i: u32) -> u32 {
    return keys[key_base + i];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    key_base = wid.x * KEY_STRIDE;
    let tau = radix_select(lid, KEY_SLOTS, TAU_RANK, 2u);  // its last barrier follows every key's read
//#if CLEAR
    for (var i = lid; i < KEY_SLOTS; i += WG) {
        keys[key_base + i] = 0u;
    }
//#endif
    if (lid == 0u) {
        keys[key_base + KEY_SLOTS] = tau;
    }
}
