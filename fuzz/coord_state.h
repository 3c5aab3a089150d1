/* The coordinator's state directory as the coordinator fuzz targets
 * (fuzz_coord.c, fuzz_journal.c) give it: a model config and a data file
 * in its data root, removed with what the coordinators wrote there.
 * Header-only; its includer defines _XOPEN_SOURCE 700 first (nftw). */
#ifndef NL_FUZZ_COORD_STATE_H
#define NL_FUZZ_COORD_STATE_H

#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>

static inline int coord_state_remove_entry(const char *path, const struct stat *st, int flag,
                                           struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

/* dir and everything in it */
static inline void coord_state_remove(const char *dir)
{
    nftw(dir, coord_state_remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* dir/cfg.yaml (cfg_yaml) and dir/data/d.txt (20 lines of words): 0, or
 * -1 when a file cannot be written. */
static inline int coord_state_fill(const char *dir, const char *cfg_yaml)
{
    char path[400];
    snprintf(path, sizeof path, "%s/cfg.yaml", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fputs(cfg_yaml, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/data", dir);
    mkdir(path, 0700);
    snprintf(path, sizeof path, "%s/data/d.txt", dir);
    if (!(f = fopen(path, "w")))
        return -1;
    for (int i = 0; i < 20; i++)
        fprintf(f, "some words to train on %d\n", i);
    fclose(f);
    return 0;
}

#endif
