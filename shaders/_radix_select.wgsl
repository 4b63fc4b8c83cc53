// Snippet (//#include _radix_select): the rank-th largest of n u32 keys, found by all WG threads of a
// workgroup together (WG >= 16): one 256-bin histogram per 8-bit digit, from the top byte down; each
// round's bin is found by thread 0 over 16 sums of 16 bins. The including kernel defines WG, RADIX_PER
// and `fn radix_key(i: u32) -> u32`, key i (i < n), the same every time it is asked. Up to
// RADIX_PER * WG keys are read once, all loads issued together, and kept in registers for every
// round (a rolled loop's loads wait for each other: naga bounds every loop); more are read each round.
//
// Returns the key's top 8 * rounds bits, the rest zero (rounds = 4: the key itself): at least `rank`
// keys reach it. Fewer than `rank` keys: 0.

const RADIX_BINS: u32 = 256u;
var<workgroup> radix_hist: array<atomic<u32>, RADIX_BINS>;
var<workgroup> radix_hist_16: array<u32, 16>;
var<workgroup> radix_pick: vec2<u32>;  // (the key's bits so far, keys at or above them still needed)

// A thread's run of keys in one bin, added at once: most keys share their top bytes, and workgroup
// atomics on one address queue one after another. run = (bin, keys so far).
fn radix_count(key: u32, fixed: u32, prefix: u32, shift: u32, run: ptr<function, vec2<u32>>) {
    if ((key & fixed) == prefix) {
        let bin = (key >> shift) & 0xffu;
        if ((*run).y > 0u && bin != (*run).x) {
            atomicAdd(&radix_hist[(*run).x], (*run).y);
            (*run).y = 0u;
        }
        *run = vec2<u32>(bin, (*run).y + 1u);
    }
}

fn radix_select(lid: u32, n: u32, rank: u32, rounds: u32) -> u32 {
    let cached = n <= RADIX_PER * WG;
    var mine: array<u32, RADIX_PER>;
    if (cached) {
//#for t in RADIX_PER
        if (lid + {{t}}u * WG < n) {
            mine[{{t}}] = radix_key(lid + {{t}}u * WG);
        }
//#endfor
    }
    var prefix = 0u;
    var need = rank;
    for (var round = 0u; round < rounds; round++) {
        let shift = 24u - 8u * round;
        let fixed = ~(0xffffffffu >> (8u * round));  // the bits earlier rounds chose
        for (var b = lid; b < RADIX_BINS; b += WG) {
            atomicStore(&radix_hist[b], 0u);
        }
        workgroupBarrier();
        var run = vec2<u32>(0u, 0u);
        if (cached) {
//#for t in RADIX_PER
            if (lid + {{t}}u * WG < n) {
                radix_count(mine[{{t}}], fixed, prefix, shift, &run);
            }
//#endfor
        } else {
            for (var i = lid; i < n; i += WG) {
                radix_count(radix_key(i), fixed, prefix, shift, &run);
            }
        }
        if (run.y > 0u) {
            atomicAdd(&radix_hist[run.x], run.y);
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
