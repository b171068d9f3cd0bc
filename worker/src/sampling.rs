//! Sampling parameters between the wire and the engine, converted here only: both servers
//! read them from requests and the decode server forwards them to its prefill server.

use pdserve_engine::sampling::SamplingParams;
use pdserve_proto::pb;

/// The engine's parameters for a request's; absent means greedy.
pub fn sampling_from_pb(s: Option<pb::SamplingParams>) -> SamplingParams {
    s.map_or_else(SamplingParams::default, |s| SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        seed: s.seed,
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        resumed_tokens: s.resumed_tokens,
    })
}

/// `p` on the wire (a `top_k` past `u32` keeps every token anyway, as `u32::MAX` does).
pub fn sampling_to_pb(p: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        seed: p.seed,
        min_p: p.min_p,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        resumed_tokens: p.resumed_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_is_greedy_and_the_wire_round_trips() {
        assert_eq!(sampling_from_pb(None), SamplingParams::default());
        let wire = pb::SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
            seed: 7,
            min_p: 0.05,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            resumed_tokens: 3,
        };
        let p = sampling_from_pb(Some(wire));
        assert_eq!((p.top_k, p.seed), (40, 7));
        assert_eq!(
            (p.min_p, p.presence_penalty, p.frequency_penalty),
            (0.05, 0.5, -0.25)
        );
        assert_eq!(p.resumed_tokens, 3);
        assert_eq!(sampling_to_pb(&p), wire);
    }
}
