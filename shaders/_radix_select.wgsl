// Snippet (//#include _radix_select): the rank-th largest of n u32 keys, found by all WG threads of a
// workgroup together (WG >= 16): one 256-bin histogram per 8-bit digit, from the top byte down; each
// round's bin is found by thread 0 over 16 sums of 16 bins. The including kernel defines WG and
// `fn radix_key(i: u32) -> u32`, key i (i < n), the same every time it is asked. (H200: keys held in
// registers across the rounds, and counts added a run or a subgroup at a time, measured no faster.)
//
// Returns the key's top 8 * rounds bits, the rest zero (rounds = 4: the key itself): at least `rank`
// keys reach it. Fewer than `rank` keys: 0.

const RADIX_BINS: u32 = 256u;
var<workgroup> radix_hist: array<atomic<u32>, RADIX_BINS>;
var<workgroup> radix_hist_16: array<u32, 16>;
var<workgroup> radix_pick: vec2<u32>;  // (the key's bits so far, keys at or above them still needed)

fn radix_select(lid: u32, n: u32, rank: u32, rounds: u32) -> u32 {
    var prefix = 0u;
    var need = rank;
    for (var round = 0u; round < rounds; round++) {
        let shift = 24u - 8u * round;
        let fixed = ~(0xffffffffu >> (8u * round));  // the bits earlier rounds chose
        for (var b = lid; b < RADIX_BINS; b += WG) {
            atomicStore(&radix_hist[b], 0u);
        }
        workgroupBarrier();
        for (var i = lid; i < n; i += WG) {
            let key = radix_key(i);
            if ((key & fixed) == prefix) {
                atomicAdd(&radix_hist[(key >> shift) & 0xffu], 1u);
            }
        }
        workgroupBarrier();
        if (lid < 16u) {
            var sum = 0u;
            for (var j = 0u; j < 16u; j++) {
                sum += atomicLoad(&radix_hist[16u * lid + j]);
            }
            radix_hist_16[lid] = sum;
        }
        workgroupBarrier();
        if (lid == 0u) {  // the highest bin where the keys counted from the top reach `need`
            var above = 0u;
            var c = 15u;
            while (c > 0u && above + radix_hist_16[c] < need) {
                above += radix_hist_16[c];
                c -= 1u;
            }
            var b = 16u * c + 15u;
            while (b > 16u * c && above + atomicLoad(&radix_hist[b]) < need) {
                above += atomicLoad(&radix_hist[b]);
                b -= 1u;
            }
            radix_pick = vec2<u32>(prefix | (b << shift), need - above);
        }
        let picked = workgroupUniformLoad(&radix_pick);
        prefix = picked.x;
        need = picked.y;
    }
    return prefix;
}
