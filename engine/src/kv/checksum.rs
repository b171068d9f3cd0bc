//! The KV canary's checksum of one page or state slot, defined so that it can be computed
//! where the pool lives: the bytes as little-endian 8-byte words `w_i`, each keyed by its
//! position, summed in any order:
//!
//! `checksum = mix(n ^ Σ_i mix(w_i + (i + 1) * φ))` (wrapping), `mix` = splitmix64's
//! finalizer, `φ` = 2^64 / golden ratio.
//!
//! For a fixed position the term is a bijection of the word, so any change to one word
//! changes the sum, and swapped words change it too (their keys differ). The CUDA backend
//! computes the same value with one block per page (`cu/audit.cu`); a sum has no order, so
//! the threads' partial sums need no fixed reduction tree.

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finalizer: a bijection of u64 with full avalanche.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The checksum of one region (a length not a multiple of 8 is zero-padded; layouts
/// align every region to 16 bytes).
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut sum: u64 = 0;
    let mut words: u64 = 0;
    for (i, c) in bytes.chunks(8).enumerate() {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        let key = (i as u64 + 1).wrapping_mul(PHI);
        sum = sum.wrapping_add(mix(u64::from_le_bytes(w).wrapping_add(key)));
        words += 1;
    }
    mix(sum ^ words)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn single_bit_flips_change_it() {
        let a: Vec<u8> = (0..64u32).map(|i| (i * 37 % 251) as u8).collect();
        for i in 0..a.len() * 8 {
            let mut b = a.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert_ne!(checksum(&a), checksum(&b), "bit {i}");
        }
    }

    #[test]
    fn swapped_words_and_lengths_change_it() {
        let mut a = vec![0u8; 32];
        a[0] = 1;
        let mut b = vec![0u8; 32];
        b[8] = 1;
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&[0u8; 16]), checksum(&[0u8; 32]));
        // A zeroed region has a checksum of its own (not 0), so zeroing is seen too.
        assert_ne!(checksum(&[0u8; 16]), 0);
    }

    #[test]
    fn known_value() {
        // Pins the definition the CUDA kernel implements (`cu/audit.cu`).
        let bytes: Vec<u8> = (0..32u8).collect();
        assert_eq!(checksum(&bytes), checksum_reference(&bytes));
        assert_eq!(mix(0), 0);
        assert_eq!(mix(1), 0x5692_161D_100B_05E5);
    }

    /// The formula written out once more, word by word.
    fn checksum_reference(bytes: &[u8]) -> u64 {
        let n = bytes.len() / 8;
        let mut s = 0u64;
        for i in 0..n {
            let w = u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
            s = s.wrapping_add(mix(w.wrapping_add((i as u64 + 1).wrapping_mul(PHI))));
        }
        mix(s ^ n as u64)
    }
}
