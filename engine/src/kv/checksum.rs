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

/// The smallest section the canary checksums on its own, and the most sections per page
/// or state slot: one checksum per section lets a violation name the byte ranges that
/// changed, at a host copy of at most 8 bytes per KiB of pool (and 512 bytes per region).
pub const MIN_SECTION_BYTES: usize = 1024;
pub const MAX_SECTIONS: usize = 64;

/// How many equal sections (each a whole number of 8-byte words) a region of `bytes`
/// bytes is checksummed in: the most up to [`MAX_SECTIONS`] that keeps sections at least
/// [`MIN_SECTION_BYTES`] long; 1 for a region not a multiple of 8 bytes.
pub fn sections(bytes: usize) -> usize {
    if !bytes.is_multiple_of(8) {
        return 1;
    }
    let most = (bytes / MIN_SECTION_BYTES).clamp(1, MAX_SECTIONS);
    (1..=most)
        .rev()
        .find(|k| (bytes / 8).is_multiple_of(*k))
        .unwrap_or(1)
}

/// The checksums of a region's [`sections`], in order: what the canary compares.
pub fn section_checksums(bytes: &[u8]) -> Vec<u64> {
    let k = sections(bytes.len());
    bytes
        .chunks((bytes.len() / k).max(1))
        .map(checksum)
        .collect()
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

    #[test]
    fn sections_split_a_region_evenly_within_the_bounds() {
        assert_eq!(sections(100), 1);
        assert_eq!(sections(1000), 1);
        assert_eq!(sections(4096), 4);
        // 3072 bytes = 384 words: 3 sections of 1 KiB.
        assert_eq!(sections(3072), 3);
        // 2056 bytes = 257 words (prime): no even split into >= 1 KiB sections but one.
        assert_eq!(sections(2056), 1);
        assert_eq!(sections(1 << 20), MAX_SECTIONS);
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
        let sums = section_checksums(&bytes);
        assert_eq!(sums.len(), 4);
        assert_eq!(sums[2], checksum(&bytes[2048..3072]));
        let mut b = bytes.clone();
        b[3000] ^= 1;
        let changed: Vec<usize> = section_checksums(&b)
            .iter()
            .zip(&sums)
            .enumerate()
            .filter(|(_, (x, y))| x != y)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(changed, vec![2]);
    }
}
