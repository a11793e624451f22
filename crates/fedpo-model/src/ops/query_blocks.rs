//! Which keys each block of queries sees, so that attention computes only those scores.
//!
//! Under the causal mask query `r` sees keys `0..=r`, so half of a `t x t` score matrix is
//! masked out, and a forked sequence's branch two also skips branch one's keys ([`Fork`]).
//! Computing the whole square and zeroing the masked part did twice the work the mask
//! leaves (more with forks), in the heads' small matmuls where it shows most.
//!
//! Here queries go in blocks of at most [`MAX_ROWS`] rows, with a cut where branch two
//! starts, so that every query of a block has the same hidden keys. A block's keys are at
//! most two contiguous segments ending at its last query, packed side by side into its
//! score rows: what is left masked is the block's own upper triangle.

use std::ops::Range;

use super::fork::Fork;

/// Rows per block at most: large enough for the heads' matmuls to run near full speed,
/// small enough that the blocks' triangles (the work they waste) stay a small share.
pub(super) const MAX_ROWS: usize = 64;

/// A block of queries and the keys they see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct QueryBlock {
    /// The queries, a range of the sequence's rows.
    pub(super) rows: Range<usize>,
    /// The keys, in order and disjoint; the last one ends at `rows.end`.
    pub(super) keys: Vec<Range<usize>>,
}

impl QueryBlock {
    /// Keys in all: the width of the block's packed score rows.
    pub(super) fn width(&self) -> usize {
        self.keys.iter().map(|k| k.len()).sum()
    }

    /// Each key segment with the packed column it starts at.
    pub(super) fn segments(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.keys.iter().scan(0, |column, keys| {
            let start = *column;
            *column += keys.len();
            Some((start, keys.clone()))
        })
    }

    /// How many leading packed columns query `r` (a row of the block) sees: all but the
    /// keys after it, which are the last ones.
    pub(super) fn visible(&self, r: usize) -> usize {
        self.width() - (self.rows.end - 1 - r)
    }
}

/// The blocks of a sequence of `t` tokens, in order, covering every row once.
pub(super) fn query_blocks(t: usize, fork: Option<Fork>) -> Vec<QueryBlock> {
    let split = fork.map_or(t, |f| f.second_start().min(t));
    let mut blocks = Vec::new();
    for part in [0..split, split..t] {
        let n = part.len().div_ceil(MAX_ROWS);
        for i in 0..n {
            let rows = part.start + part.len() * i / n..part.start + part.len() * (i + 1) / n;
            let hidden = fork.map_or(0..0, |f| f.hidden_from(rows.start));
            let hidden = if hidden.is_empty() { 0..0 } else { hidden };
            let keys = [0..hidden.start, hidden.end..rows.end].into_iter().filter(|k| !k.is_empty()).collect();
            blocks.push(QueryBlock { rows, keys });
        }
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether query `r` sees key `c`, from the masks' definitions.
    fn sees(fork: Option<Fork>, r: usize, c: usize) -> bool {
        c <= r && !fork.map_or(0..0, |f| f.hidden_from(r)).contains(&c)
    }

    #[test]
    fn every_query_sees_exactly_its_unmasked_keys_through_its_block() {
        let forks = [
            None,
            Some(Fork { prefix: 64, first: 64 }),
            Some(Fork { prefix: 0, first: 5 }),
            Some(Fork { prefix: 7, first: 0 }),
            Some(Fork { prefix: 3, first: 100 }),
            Some(Fork { prefix: 130, first: 70 }),
        ];
        for t in [1, 5, 64, 65, 200, 203] {
            for fork in forks.iter().copied().filter(|f| f.is_none_or(|f| f.second_start() <= t)) {
                let blocks = query_blocks(t, fork);
                let covered: Vec<usize> = blocks.iter().flat_map(|b| b.rows.clone()).collect();
                assert_eq!(covered, (0..t).collect::<Vec<_>>(), "t {t}, {fork:?}");
                for block in &blocks {
                    assert!(block.rows.len() <= MAX_ROWS && !block.rows.is_empty());
                    assert_eq!(block.keys.last().map(|k| k.end), Some(block.rows.end));
                    let packed: Vec<usize> = block.keys.iter().flat_map(|k| k.clone()).collect();
                    for r in block.rows.clone() {
                        let seen: Vec<usize> = packed[..block.visible(r)].to_vec();
                        let expected: Vec<usize> = (0..t).filter(|&c| sees(fork, r, c)).collect();
                        assert_eq!(seen, expected, "t {t}, {fork:?}, query {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_shared_prompt_layout_scores_under_three_fifths_of_the_square() {
        // the benchmark's rows: a 64-token prompt, then two 64-token responses
        let blocks = query_blocks(192, Some(Fork { prefix: 64, first: 64 }));
        let scored: usize = blocks.iter().map(|b| b.rows.len() * b.width()).sum();
        assert_eq!(scored, 64 * (64 + 128 + 128));
        assert!((scored as f64) < 0.6 * 192.0 * 192.0);
        let columns: Vec<(usize, Range<usize>)> = blocks[2].segments().collect();
        assert_eq!(columns, [(0, 0..64), (64, 128..192)]);
    }
}
