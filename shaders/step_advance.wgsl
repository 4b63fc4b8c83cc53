// The last dispatch of a step queued behind others in one submit: log what the host reads of the
// step, and advance StepParams to the next step, on the GPU.
//
//   decode step:        token_log[slot] = ids[0];  step.pos += 1;  step.slot += 1
//   VERIFY (a speculative step, verify or draft-off; its next step's draft kernel sets the other fields):
//                       token_log[slot * (K + 3) + i] = out[i]  (i < K + 2: n_emitted, the tokens)
//                       token_log[slot * (K + 3) + K + 2] = state[0]  (the step's draft length)
//                       step.slot += 1
//
// A buffer copy between dispatches ends the compute pass and waits on both sides of it, so each
// step used to pay for one or two: StepParams copied in, its output copied out for the host. Now the
// host sets the submit's first StepParams (slot 0) before the submit, later steps run on what this
// kernel leaves, and one copy after the submit's last step hands token_log to the host.
//
// Bindings:
//   decode:  0 ids        [>= 1] u32  the chosen token (Argmax / GPUSampler wrote it): the next input
//   VERIFY:  0 out        [K + 2] u32 the acceptance's n_emitted and tokens
//            1 state      [>= 1] u32  SpecBuffers.state ([0] = draft length)
//   then     step         [4] u32     the model's StepParams uniform (n_tokens, pos, kv_capacity,
//                                     slot), written here as storage for the next step's dispatches
//            token_log    [SLOTS * WORDS] u32  each step's words, by slot
//
// Dispatch: (1, 1, 1); one invocation does it all.

const SLOTS: u32 = ${SLOTS};

//#if VERIFY
const K: u32 = ${K};
const WORDS: u32 = K + 3u;
@group(0) @binding(0) var<storage, read> out: array<u32>;
@group(0) @binding(1) var<storage, read> state: array<u32>;
@group(0) @binding(2) var<storage, read_write> step: array<u32>;
@group(0) @binding(3) var<storage, read_write> token_log: array<u32>;
//#else
@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read_write> step: array<u32>;
@group(0) @binding(2) var<storage, read_write> token_log: array<u32>;
//#endif

@compute @workgroup_size(1)
fn main() {
    let slot = step[3];
//#if VERIFY
    if (slot < SLOTS) {
        for (var i = 0u; i < K + 2u; i++) {
            token_log[slot * WORDS + i] = out[i];
        }
        token_log[slot * WORDS + K + 2u] = state[0];
    }
//#else
    if (slot < SLOTS) {
        token_log[slot] = ids[0];
    }
    step[1] = step[1] + 1u;
//#endif
    step[3] = slot + 1u;
}
